"""A comparison's statistics: per metric, each variant's mean +/- std over seeds, its paired difference to the
baseline (95 %, each on its own), and the corrected families (``fedllm.run.stats``).

One run's number is one draw: the partition, the sampled clients, the initialization and the local batches
all come from ``federation.seed``, and float kernels differ across machines. So every variant runs the same
seeds (seed s gives every variant the same partition and the same client draws) and is compared seed by
seed. A difference whose interval holds zero is reported as such, not as a win.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from fedllm.run.compare.metrics import BETTER, METRICS

# two-sided 95% quantiles of Student's t, by degrees of freedom (1..30); 1.96 beyond
_T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


def t_quantile(df: int) -> float:
    """The 0.975 quantile of Student's t with ``df`` degrees of freedom."""
    return _T975[df - 1] if 1 <= df <= len(_T975) else 1.96


def describe(values: list[float]) -> dict[str, float]:
    """Mean and sample standard deviation (0 for a single value; NaN where a value is not finite, e.g.
    the epsilon of a DP run without noise, which is infinite)."""
    finite = all(math.isfinite(v) for v in values)
    return {
        "mean": statistics.fmean(values),
        "std": (statistics.stdev(values) if finite else math.nan) if len(values) > 1 else 0.0,
        "n": len(values),
    }


def paired(values: list[float], baseline: list[float]) -> dict[str, float | bool]:
    """Mean per-seed difference to the baseline, with its 95% t interval."""
    diffs = [v - b for v, b in zip(values, baseline, strict=True)]
    mean = statistics.fmean(diffs)
    if len(diffs) < 2 or not all(math.isfinite(d) for d in diffs):
        return {"diff": mean, "low": math.nan, "high": math.nan, "excludes_zero": False}
    half = t_quantile(len(diffs) - 1) * statistics.stdev(diffs) / math.sqrt(len(diffs))
    return {
        "diff": mean,
        "low": mean - half,
        "high": mean + half,
        "excludes_zero": mean - half > 0 or mean + half < 0,
    }


def corrected(
    per_seed: dict[str, list[float]],
    base: str,
    references: list[str],
    better: int | None,
    alpha: float = 0.05,
    references_apart: bool = False,
) -> dict[str, Any]:
    """One metric's families of paired comparisons, each corrected for its own size
    (``fedllm.run.stats``): every other row against ``base``, and (where the metric has a better
    direction) every other federated row against the best federated one (``references``, e.g. local-only
    and centralized, are never "the best"); with the smallest difference each family can detect (80 %
    power, from the median spread of its per-seed differences). ``references_apart``: the references
    against ``base`` form a family of their own (secondary), so the primary family is the federated rows
    alone, as a design that names one primary family asks."""
    from fedllm.run.stats import correct, detectable, paired_test

    def family(ref: str, names: list[str]) -> dict[str, Any]:
        comps = correct([paired_test(n, per_seed[n], per_seed[ref]) for n in names], alpha)
        sds = [c.sd for c in comps if math.isfinite(c.sd)]
        n = min((c.n for c in comps), default=0)
        mde = detectable(statistics.median(sds), n, len(comps), alpha) if sds else math.nan
        return {"reference": ref, "m": len(comps), "detectable": mde, "comparisons": [vars(c) for c in comps]}

    others = [n for n in per_seed if n != base]
    refs = [n for n in others if n in references] if references_apart else []
    out: dict[str, Any] = {"vs_baseline": family(base, [n for n in others if n not in refs])}
    if refs:
        out["references_vs_baseline"] = family(base, refs)
    federated = [n for n in per_seed if n not in references]
    if better is not None and len(federated) > 1:
        best = max(federated, key=lambda n: better * statistics.fmean(per_seed[n]))
        out["vs_best"] = family(best, [n for n in per_seed if n != best])
    return out


def summarize(
    results: dict[str, dict[int, dict[str, float | None]]],
    references: list[str] | None = None,
    references_apart: bool = False,
) -> dict[str, Any]:
    """Per metric: every variant's mean/std and its paired difference to the first variant (95 %, each on its
    own), and the corrected families of :func:`corrected` (over the seeds every variant has)."""
    names = list(results)
    base = names[0]
    seeds = sorted(set.intersection(*(set(r) for r in results.values())))
    table: dict[str, dict[str, dict[str, Any]]] = {}
    families: dict[str, dict[str, Any]] = {}
    reported = [m for r in results.values() for per_seed in r.values() for m in per_seed]
    for metric in dict.fromkeys([*METRICS, *reported]):  # the built-in metrics first, then the features'
        per: dict[str, dict[str, Any]] = {}
        for name in names:
            got = [results[name][s].get(metric) for s in seeds]  # (a metric some runs lack: skipped)
            vals = [float(v) for v in got if v is not None]
            if len(vals) < len(got):
                continue
            entry: dict[str, Any] = dict(describe(vals))
            if METRICS.get(metric, ("",))[0].split(":")[0] in ("gain", "drop"):
                # a within-run change (after vs before round 1): paired by construction, its own interval
                entry["vs_before"] = paired(vals, [0.0] * len(vals))
            base_got = [results[base][s].get(metric) for s in seeds]
            base_vals = [float(v) for v in base_got if v is not None]
            if name != base and len(base_vals) == len(base_got):
                entry["vs_" + base] = paired(vals, base_vals)
            per[name] = entry
        if per:
            table[metric] = per
            full = {n: [float(results[n][s][metric]) for s in seeds] for n in per}  # type: ignore[arg-type]
            if len(full) > 1 and base in full and len(seeds) > 1:
                families[metric] = corrected(
                    full, base, references or [], BETTER.get(metric), references_apart=references_apart
                )
    return {"baseline": base, "seeds": seeds, "metrics": table, "corrected": families}


def drift_curve(t: dict[str, Any], drift: str = "general_agreement") -> list[dict[str, Any]]:
    """A tuned variant's points as (x: drift, y: score), means over the tuning seeds every point of it ran
    (under successive halving the first alone: each seed has its own validation chats, so a mean over other
    seeds would not be comparable), in the grid's order; points missing either number left out."""
    seeds = [
        s for s in t["points"][0]["per_seed"] if all(p["per_seed"].get(s) is not None for p in t["points"])
    ]
    out = []
    for p in t["points"]:
        ys = [p["per_seed"][s] for s in seeds]
        xs = [p.get("drift_per_seed", {}).get(s) for s in seeds]
        if seeds and all(v is not None and math.isfinite(v) for v in ys + xs):
            out.append({"tag": p["tag"], "short": p["short"], "x": sum(xs) / len(xs), "y": sum(ys) / len(ys),
                        "seeds": seeds})  # fmt: skip
    return out


def matched_drift(
    tuning: dict[str, Any], baseline: str, levels: int = 5, drift: str = "general_agreement"
) -> dict[str, dict[str, Any]]:
    """Each tuned variant against ``baseline`` at equal drift, from their grids (:func:`drift_curve`): over
    the drift range both curves reach, each score interpolated linearly in the drift at ``levels`` evenly
    spaced drifts, the differences (variant minus baseline); "lower" where every difference is below 0,
    "higher" where every one is above, "crosses" otherwise, "no shared drift" where the ranges do not meet.
    Descriptive (a few tuning seeds, no interval): whether one method scores better than another at the
    same distance from the base, whatever rate each needed to get there."""
    import numpy as np

    curves = {name: drift_curve(t, drift) for name, t in tuning["variants"].items()}
    base = sorted(curves.get(baseline, []), key=lambda p: p["x"])
    out: dict[str, dict[str, Any]] = {}
    for name, pts in curves.items():
        if name == baseline or len(pts) < 2 or len(base) < 2:
            continue
        pts = sorted(pts, key=lambda p: p["x"])
        low = max(pts[0]["x"], base[0]["x"])
        high = min(pts[-1]["x"], base[-1]["x"])
        if low >= high:
            out[name] = {"reading": "no shared drift", "range": None, "diffs": []}
            continue
        xs = np.linspace(low, high, levels)
        mine = np.interp(xs, [p["x"] for p in pts], [p["y"] for p in pts])
        theirs = np.interp(xs, [p["x"] for p in base], [p["y"] for p in base])
        diffs = [float(d) for d in mine - theirs]
        reading = "lower" if max(diffs) < 0 else "higher" if min(diffs) > 0 else "crosses"
        out[name] = {"reading": reading, "range": [float(low), float(high)], "diffs": diffs,
                     "mean_diff": float(np.mean(diffs))}  # fmt: skip
    return out
