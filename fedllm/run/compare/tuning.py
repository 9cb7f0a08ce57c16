"""How a variant's value is chosen: a grid over one or more config keys (the learning rate first), run on
tuning seeds, scored on the validation split, the best point kept; then the table runs at that point.

Two methods compared at one shared learning rate differ in how far they move as much as in how they
aggregate (FedIT averages A and B apart, which shrinks its update; a method that merges moves further in
the same steps). So each variant earns its row at its own best value, picked on data the table never scores:

- **the grid**: ``--tune KEY=V1,V2,...`` for every variant, ``--tune NAME:KEY=V1,...`` for one (it adds a
  key, or replaces the common key's values for that variant); several keys form their product;
- **the tuning runs**: every point at every ``--tune-seeds`` seed (seeds the table does not use), evaluated
  on the validation split (``eval.split=validation``, so the held-out test set is not read) and only on what
  the choice and its figure need (:data:`TUNING_EVALUATION`); they land in ``OUT/tuning/<variant>/<point>/``;
- **the choice** (:func:`decide`): the point with the best mean score over the tuning seeds (the validation
  loss; a point where any seed's score is not finite never wins); where the chosen value of a numeric key sits
  at an edge of its line of the grid (the other keys at their chosen values), the grid is extended by one
  point beyond it, continuing the grid's ratio (or step), up to ``--tune-extend`` times, then chosen again;
  a choice still at an edge is said in one line;
- **the record**: every point's per-seed scores and their mean, its drift (general agreement with the base),
  the chosen point, the points added and the edge line, in ``OUT/tuning/tuning.json``, in ``compare.json``
  and at the top of ``compare.md``; :func:`record_from_folders` recomputes the same record, read-only, from
  nothing but the kept runs (``scripts/tuning_choice.py``).
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedllm.run.compare.metrics import BETTER, run_metrics
from fedllm.run.compare.variants import Planned, Variant, plan

# what a tuning run evaluates: the validation split's loss and the general prompts' agreement with the base
# (the drift figure's other axis, where the config asks for general prompts), nothing else
TUNING_EVALUATION = [
    "eval.split=validation",
    "eval.benchmark=none",
    "eval.generate_size=0",
    "eval.personalized=false",
]
DRIFT = "general_agreement"


def canonical(text: str) -> str:
    """A grid value as one spelling (``5e-4`` and ``0.0005`` are one point): an integer as an integer, a
    number as Python's shortest exact float text, anything else as given."""
    t = text.strip()
    try:
        return str(int(t))
    except ValueError:
        pass
    try:
        v = float(t)
    except ValueError:
        return t
    return repr(v) if math.isfinite(v) else t


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


@dataclass(frozen=True)
class Point:
    """One point of a variant's grid: a value (canonical text) per tuned key, in the grid's key order."""

    values: tuple[tuple[str, str], ...]

    @property
    def tag(self) -> str:
        """Its folder name and its name in the record: ``key=value,key=value``."""
        return ",".join(f"{k}={v}" for k, v in self.values)

    @property
    def overrides(self) -> list[str]:
        return [f"{k}={v}" for k, v in self.values]

    @property
    def short(self) -> str:
        """The values alone (a figure's label)."""
        return ",".join(v for _, v in self.values)

    def get(self, key: str) -> str:
        return dict(self.values)[key]

    def with_value(self, key: str, value: str) -> Point:
        return Point(tuple((k, value if k == key else v) for k, v in self.values))

    @classmethod
    def from_tag(cls, tag: str) -> Point:
        return cls(tuple((k, v) for k, _, v in (part.partition("=") for part in tag.split(","))))


def parse_tune(text: str) -> tuple[str | None, str, list[str]]:
    """``[variant:]key=v1,v2,...`` as (variant or None, key, canonical values); a clear error naming the
    option otherwise."""
    head, eq, rest = text.partition("=")
    if not eq or not head or not rest:
        raise ValueError(f"--tune {text!r}: expected KEY=V1,V2,... or VARIANT:KEY=V1,V2,...")
    variant, colon, key = head.partition(":")
    if not colon:
        variant, key = "", head
    elif not variant.isidentifier():
        raise ValueError(f"--tune {text!r}: {variant!r} before ':' is not a variant name")
    values = [canonical(v) for v in rest.split(",") if v.strip()]
    if len(set(values)) != len(values):
        raise ValueError(f"--tune {text!r}: a value is given twice")
    if not values:
        raise ValueError(f"--tune {text!r}: no value")
    return variant or None, key, values


def grids(variants: list[Variant], specs: list[str]) -> dict[str, dict[str, list[str]]]:
    """Each variant's grid (key -> values) from ``--tune`` specs: common ones for all, a variant's own adds
    a key or replaces the common values of one; a variant named by no --variant is refused."""
    names = {v.name for v in variants}
    common: dict[str, list[str]] = {}
    own: dict[str, dict[str, list[str]]] = {}
    for text in specs:
        variant, key, values = parse_tune(text)
        if variant is None:
            common[key] = values
        elif variant not in names:
            raise ValueError(f"--tune {text!r}: {variant!r} is not a --variant of this comparison")
        else:
            own.setdefault(variant, {})[key] = values
    return {v.name: {**common, **own.get(v.name, {})} for v in variants}


def product(grid: dict[str, list[str]]) -> list[Point]:
    """Every point of a grid, in the order its values were given."""
    keys = list(grid)
    return [Point(tuple(zip(keys, combo, strict=True))) for combo in itertools.product(*grid.values())]


def score_of(values: list[float | None], better: int) -> float:
    """A point's score over its seeds: the mean; the worst possible where a seed has none or a non-finite
    one (a diverged run never wins)."""
    if not values or any(v is None or not math.isfinite(v) for v in values):
        return -math.inf if better > 0 else math.inf
    return statistics.fmean(v for v in values if v is not None)


def _beyond(values: list[str], edge: str) -> str | None:
    """The next value past ``edge`` (the smallest or largest of ``values``, all numbers): the grid's ratio
    continued where it is geometric (every value > 0, one ratio between neighbours), else its step; an
    integer grid stays integer. None where it cannot go on (fewer than 2 values, or no new value)."""
    nums = sorted({float(v) for v in values})
    if len(nums) < 2:
        return None
    e = float(edge)
    neighbour = nums[1] if e == nums[0] else nums[-2]
    ratios = [b / a for a, b in itertools.pairwise(nums)] if nums[0] > 0 else []
    geometric = bool(ratios) and max(ratios) / min(ratios) < 1 + 1e-6
    nxt = e * (e / neighbour) if geometric else e + (e - neighbour)
    if all(_is_int(v) for v in values):
        text = str(round(nxt))
    else:  # 12 significant digits: 0.003 * 0.003 / 0.001 is 0.009, not 0.009000000000000001
        text = canonical(f"{nxt:.12g}")
    return None if float(text) in nums else text


def _is_int(text: str) -> bool:
    try:
        int(text)
        return True
    except ValueError:
        return False


def decide(
    points: list[Point], scores: dict[str, list[float | None]], better: int, extensions_left: int
) -> tuple[Point, list[Point], list[str]]:
    """The chosen point (best :func:`score_of`; the grid's first of equal ones), the points to add (one per
    numeric key whose chosen value sits at an edge of its line, while ``extensions_left``) and, for the keys
    left at an edge, why (one line each)."""
    best = min(points, key=lambda p: -better * score_of(scores.get(p.tag, []), better))
    add: list[Point] = []
    edges: list[str] = []
    known = {p.tag for p in points}
    for key, value in best.values:
        line = [p.get(key) for p in points if all(v == best.get(k) for k, v in p.values if k != key)]
        if len(line) < 2 or any(_number(v) is None for v in line):
            continue
        nums = [float(v) for v in line]
        if float(value) not in (min(nums), max(nums)):
            continue
        side = "smallest" if float(value) == min(nums) else "largest"
        nxt = _beyond(line, value)
        if extensions_left > 0 and nxt is not None and best.with_value(key, nxt).tag not in known:
            add.append(best.with_value(key, nxt))
        else:
            edges.append(f"{key}={value} is the {side} value tried: the best may lie beyond the grid")
    return best, add, edges


def tuning_runs(
    config: str | None,
    variant: Variant,
    common: list[str],
    points: list[Point],
    seeds: dict[str, list[int]],
    folder: Path,
    evaluation: list[str],
) -> list[Planned]:
    """The tuning runs of ``points`` of one variant, each at its ``seeds[tag]``, in
    ``folder/<point>/seed-<s>``."""
    runs: list[Planned] = []
    for p in points:
        overrides = [*common, *variant.overrides, *p.overrides, *evaluation]
        runs += plan(config, variant.name, overrides, seeds[p.tag], folder / p.tag)
    for r in runs:
        if r.cfg.data.validation_size <= 0:
            raise ValueError(
                f"--tune: {r.label} has data.validation_size = 0: a value is chosen on a validation split "
                "(set data.validation_size, e.g. to the size of the held-out test set)"
            )
    return runs


def finished_scores(
    points: list[Point], seeds: list[int], folder: Path, metric: str
) -> dict[str, dict[int, Any]]:
    """Each point's score at each seed whose run has finished (None: finished without one)."""
    from fedllm.run.reader import RunFolder

    out: dict[str, dict[int, Any]] = {}
    for p in points:
        runs = {s: folder / p.tag / f"seed-{s}" for s in seeds}
        out[p.tag] = {s: run_metrics(d).get(metric) for s, d in runs.items() if RunFolder(d).is_finished()}
    return out


def earned(
    points: list[Point],
    added: list[str],
    seeds: list[int],
    halving: bool,
    scores: dict[str, dict[int, Any]],
    better: int,
) -> dict[str, list[int]]:
    """The tuning seeds each point runs at. Without ``halving``: all of them. With it (successive halving):
    every point of the grid runs the first seed; at each next seed, the better half (rounded up) of the
    points that ran every seed so far, by their mean so far, runs it too, so the full grid costs one seed
    and only its best points the rest. A point ``added`` past an edge runs every seed (it is chosen on the
    same mean as the survivors). Stops at the first seed whose runs have not all finished (``scores``)."""
    out = {p.tag: list(seeds) for p in points if p.tag in added or not halving}
    alive = [p for p in points if p.tag not in out]
    out.update({p.tag: seeds[:1] for p in alive})
    for k in range(1, len(seeds)):
        so_far = seeds[:k]
        if any(s not in scores.get(p.tag, {}) for p in alive for s in so_far):
            break  # this level's runs come first
        alive.sort(key=lambda p: -better * score_of([scores[p.tag][s] for s in so_far], better))
        alive = alive[: -(-len(alive) // 2)]  # (a stable sort: of equal means, the grid's first)
        for p in alive:
            out[p.tag].append(seeds[k])
    return out


def point_record(point: Point, seeds: list[int], folder: Path, metric: str, better: int) -> dict[str, Any]:
    """One point's per-seed scores and drift (read from its finished runs; None at a seed it did not run)
    and its score over every seed (None unless it ran them all and each is finite: what is chosen on)."""
    per_seed: dict[str, float | None] = {}
    drift: dict[str, float | None] = {}
    for s in seeds:
        m = run_metrics(folder / point.tag / f"seed-{s}")
        per_seed[str(s)], drift[str(s)] = m.get(metric), m.get(DRIFT)
    score = score_of(list(per_seed.values()), better)
    return {
        "tag": point.tag,
        "values": dict(point.values),
        "short": point.short,
        "per_seed": per_seed,
        "mean": score if math.isfinite(score) else None,
        "drift_per_seed": drift,
    }


def variant_record(
    points: list[Point], seeds: list[int], folder: Path, metric: str, better: int, extensions_left: int
) -> tuple[dict[str, Any], list[Point]]:
    """A variant's record over its points' finished runs (:func:`decide` on them) and the points still to
    add."""
    recs = [point_record(p, seeds, folder, metric, better) for p in points]
    scores = {r["tag"]: list(r["per_seed"].values()) for r in recs}
    best, add, edges = decide(points, scores, better, extensions_left)
    keys: dict[str, list[str]] = {}
    for p in points:
        for k, v in p.values:
            keys.setdefault(k, [])
            if v not in keys[k]:
                keys[k].append(v)
    return {
        "keys": keys,
        "points": recs,
        "chosen": dict(best.values),
        "chosen_tag": best.tag,
        "edge_note": "; ".join(edges) or None,
    }, add


def tune(
    config: str | None,
    variants: list[Variant],
    common: list[str],
    grid_of: dict[str, dict[str, list[str]]],
    seeds: list[int],
    out_root: Path,
    run_all: Callable[[list[Planned]], object],
    metric: str = "validation_loss",
    extend: int = 1,
    evaluation: list[str] | None = None,
    halving: bool = False,
    check: Callable[[list[Planned]], object] | None = None,
) -> dict[str, Any]:
    """Run every variant's grid on ``seeds`` (all of them, or by successive ``halving``: :func:`earned`;
    ``run_all(runs)`` checks and runs them: the comparison's own staleness, identity and execution),
    extend where a choice sits at an edge, and return the record (the comparison writes it to
    ``OUT/tuning/``). Variants with an empty grid are not tuned. ``check(runs)``: the comparison's check of
    kept folders, run on every point of the grid at every seed before any score is read (a finished run
    that halving does not plan now, an earlier sitting's of other code or settings, would otherwise be read
    unchecked)."""
    better = BETTER.get(metric, -1)
    evaluation = [*TUNING_EVALUATION, *(evaluation or [])]
    tuned = [v for v in variants if grid_of.get(v.name)]
    points = {v.name: product(grid_of[v.name]) for v in tuned}
    added: dict[str, list[str]] = {v.name: [] for v in tuned}
    folder = out_root / "tuning"

    def plans() -> dict[str, dict[str, list[int]]]:
        return {
            v.name: earned(points[v.name], added[v.name], seeds, halving,
                           finished_scores(points[v.name], seeds, folder / v.name, metric), better)
            for v in tuned
        }  # fmt: skip

    while True:
        if check is not None:
            every = {v.name: {p.tag: list(seeds) for p in points[v.name]} for v in tuned}
            check([r for v in tuned for r in tuning_runs(config, v, common, points[v.name], every[v.name],
                                                            folder / v.name, evaluation)])  # fmt: skip
        planned = plans()
        runs: list[Planned] = []
        for v in tuned:
            at = planned[v.name]
            runs += tuning_runs(config, v, common, points[v.name], at, folder / v.name, evaluation)
        run_all(runs)
        if plans() != planned:  # a halving level finished: its survivors run the next seed first
            continue
        more = False
        variants_rec: dict[str, Any] = {}
        for v in tuned:
            left = extend - len(added[v.name])
            rec, add = variant_record(points[v.name], seeds, folder / v.name, metric, better, left)
            if add:
                points[v.name] += add
                added[v.name] += [p.tag for p in add]
                more = True
            variants_rec[v.name] = {**rec, "extended": list(added[v.name]), "seeds_run": planned[v.name]}
        if not more:
            break
    record = {
        "metric": metric,
        "better": better,
        "config": config,
        "common": list(common),
        "seeds": seeds,
        "halving": halving,
        "evaluation": evaluation,
        "extend": extend,
        "variants": variants_rec,
    }
    return record


def record_from_folders(tuning_dir: Path, metric: str = "validation_loss", extend: int = 0) -> dict[str, Any]:
    """The tuning record recomputed from nothing but the kept runs under ``tuning_dir``
    (``<variant>/<point>/seed-<s>``, finished ones): the same :func:`decide` the comparison used, over the
    seeds any point of the variant ran (a point without all of them, one halving left behind, is never
    chosen), read-only (nothing is run or extended, so a choice at an edge is said as such). ``extend``:
    what the comparison allowed, recorded beside it."""
    from fedllm.run.reader import RunFolder

    better = BETTER.get(metric, -1)
    variants: dict[str, Any] = {}
    all_seeds: set[int] = set()
    for vdir in sorted(p for p in tuning_dir.iterdir() if p.is_dir() and not p.name.startswith(".")):
        found: dict[str, set[int]] = {}
        for pdir in sorted(p for p in vdir.iterdir() if p.is_dir()):
            done = {
                int(s.name.removeprefix("seed-"))
                for s in pdir.glob("seed-*")
                if s.is_dir() and RunFolder(s).is_finished()
            }
            if done:
                found[pdir.name] = done
        if not found:
            continue
        seeds = sorted(set.union(*found.values()))
        rec, _ = variant_record([Point.from_tag(t) for t in found], seeds, vdir, metric, better, 0)
        variants[vdir.name] = {**rec, "seeds": seeds}
        all_seeds |= set(seeds)
    return {"metric": metric, "better": better, "seeds": sorted(all_seeds), "extend": extend,
            "variants": variants}  # fmt: skip
