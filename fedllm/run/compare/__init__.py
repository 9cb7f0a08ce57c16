"""``fedllm compare``: variants of one config over several seeds, each at its own tuned value, with paired,
corrected differences.

Where each part lives:

- ``variants``: what a variant is, and each run's config, loaded and settled once;
- ``tuning``: how a variant's value (its learning rate, or any key) is chosen: a grid on tuning seeds,
  scored on the validation split, extended past an edge, recorded;
- ``runs``: which run folders may be reused (the same settings and the same identity: code, data, model
  file, precision, libraries) and running the others, one log each;
- ``metrics``: what is read from a finished run (of the held-out set it evaluated: test or validation);
- ``summary``: means over seeds, paired differences, the corrected families;
- ``tables`` and ``plots``: ``compare.md`` / ``.json`` / ``.csv``, the forest plot and the drift figure.

A comparison with ``tune`` first runs every variant's grid (``OUT/tuning/``) and chooses its value; then
every variant runs the table's seeds at its chosen value (``OUT/<variant>/seed-<s>``). Runs of the same
settings and identity are reused, so the same command resumes a comparison across sittings; a run of other
settings stops it before any run starts (``rerun`` runs it again), and one made by other code or data is
run again (the old one kept under ``OUT/.superseded/``). The table and the JSON carry each variant's
overrides (its chosen value among them), the grid behind each choice, each variant's config digest and the
identity that made every row. ``fedllm report OUT/*/seed-*`` plots each variant's mean with a band.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fedllm import __version__
from fedllm.run.compare import tuning
from fedllm.run.compare.metrics import BETTER, FORMATS, METRICS, run_metrics
from fedllm.run.compare.plots import corrected_figure, drift_figure, plot_corrected, plot_drift
from fedllm.run.compare.runs import (
    StaleRun,
    check_folders,
    common_identity,
    execute,
    stale_reason,
    threads_per_run,
)
from fedllm.run.compare.summary import corrected, describe, matched_drift, paired, summarize, t_quantile
from fedllm.run.compare.tables import drawn, format_corrected, format_summary, format_tuning, write_results
from fedllm.run.compare.variants import (
    Planned,
    Variant,
    config_digest,
    numbers_config,
    parse_variant,
    plan,
    settled,
    variant_digest,
)

__all__ = [
    "BETTER",
    "FORMATS",
    "METRICS",
    "StaleRun",
    "Variant",
    "compare",
    "config_digest",
    "corrected",
    "corrected_figure",
    "describe",
    "drift_figure",
    "format_corrected",
    "format_summary",
    "format_tuning",
    "numbers_config",
    "paired",
    "parse_variant",
    "plot_corrected",
    "run_metrics",
    "settled",
    "stale_reason",
    "summarize",
    "t_quantile",
    "write_results",
]


def compare(
    config: str | None,
    variants: list[Variant],
    seeds: list[int],
    out_root: Path,
    jobs: int = 1,
    extra: list[str] | None = None,
    rerun: bool = False,
    progress: bool = True,
    references: list[str] | None = None,
    tune: list[str] | None = None,
    tune_seeds: list[int] | None = None,
    tune_extend: int = 1,
    tune_metric: str = "validation_loss",
    tune_evaluation: list[str] | None = None,
    references_apart: bool = False,
    tune_halving: bool = False,
    tune_only: bool = False,
) -> dict[str, Any]:
    """Tune (where ``tune`` gives a grid), then run every variant for every seed (``jobs`` at a time) and
    summarize; see the module docstring. ``tune_only``: stop once every value is chosen (the tuning record,
    ``OUT/tuning/tuning.md`` and its drift figure written), as a design that picks its rows from the tuning
    does before its table."""
    if not variants:
        raise ValueError("give at least one --variant")
    if len({v.name for v in variants}) != len(variants):
        raise ValueError("variant names must be distinct")
    extra = extra or []
    grid_of = tuning.grids(variants, tune or [])
    record = None
    if any(grid_of.values()):
        if tune_metric not in BETTER:
            raise ValueError(
                f"--tune-metric {tune_metric!r}: not a metric with a better direction (one of "
                f"{', '.join(sorted(BETTER))})"
            )
        if not tune_seeds:
            raise ValueError("--tune needs --tune-seeds: seeds of their own, not the table's")
        shared = sorted(set(tune_seeds) & set(seeds))
        if shared:
            raise ValueError(
                f"--tune-seeds {shared} are also the table's seeds: a value is chosen on runs the table "
                "never reads (e.g. --tune-seeds 1000 1001)"
            )

        def run_all(runs: list[Planned]) -> None:
            check_folders(runs, out_root, rerun)
            execute(config, runs, jobs, desc="tuning runs", progress=progress, said=tuning_line(tune_metric))

        record = tuning.tune(
            config, variants, extra, grid_of, tune_seeds, out_root, run_all, tune_metric, tune_extend,
            tune_evaluation, tune_halving, check=lambda runs: check_folders(runs, out_root, rerun),
        )  # fmt: skip
        record = write_tuning(out_root / "tuning", record, variants[0].name)
        if tune_only:
            return {"tuning": record}
    elif tune_only:
        raise ValueError("--tune-only needs a grid (--tune KEY=V1,V2,...)")
    chosen = {v.name: record["variants"][v.name]["chosen"] for v in variants if record and v.name in
              record["variants"]}  # fmt: skip
    final = [
        Variant(v.name, [*v.overrides, *(f"{k}={x}" for k, x in chosen.get(v.name, {}).items())])
        for v in variants
    ]
    runs = [r for v in final for r in plan(config, v.name, [*extra, *v.overrides], seeds, out_root / v.name)]
    check_folders(runs, out_root, rerun)
    metrics = execute(config, runs, jobs, progress=progress)
    results = {v.name: {s: metrics[(v.name, s)] for s in seeds} for v in final}
    summary = summarize(results, references, references_apart)
    summary.update(
        {
            "config": config,
            "common_overrides": extra,
            "variants": {v.name: v.overrides for v in final},
            "references": references or [],
            "references_apart": references_apart,
            "config_digests": {v.name: variant_digest(config, [*extra, *v.overrides]) for v in final},
            "fedllm_version": __version__,
            "identity": common_identity([r.run_dir for r in runs]),
            "threads_per_run": threads_per_run(jobs),
            "runs": {v.name: {str(s): str(out_root / v.name / f"seed-{s}") for s in seeds} for v in final},
            "per_seed": {k: {str(s): m for s, m in sorted(r.items())} for k, r in results.items()},
            "tuning": record,
        }
    )
    write_results(out_root, summary)
    return summary


def write_tuning(folder: Path, record: dict[str, Any], baseline: str) -> dict[str, Any]:
    """The record with its matched-drift reading against ``baseline``, written as ``tuning.json``,
    ``tuning.md`` (:func:`format_tuning`) and ``drift.png`` in ``folder``, and returned. Variants an earlier
    call recorded there under the same rule (metric, seeds, halving, the config and the common overrides)
    and this one did not tune are kept: a table that runs some of the tuned rows (those a design admits)
    leaves the others' choices on record."""
    from fedllm.files import atomic_write_text

    path = folder / "tuning.json"
    old = json.loads(path.read_text()) if path.is_file() else None
    rule = ("metric", "seeds", "halving", "extend", "evaluation", "config", "common")
    if old is not None and all(old.get(k) == record.get(k) for k in rule):
        record = {**record, "variants": {**old["variants"], **record["variants"]}}
    record["matched_drift"] = matched_drift(record, baseline)
    atomic_write_text(path, json.dumps(record, indent=1))
    atomic_write_text(folder / "tuning.md", format_tuning(record) + "\n")
    drawn(lambda: plot_drift(record, folder / "drift.png"), "tuning/drift.png", "tuning.md")
    return record


def tuning_line(metric: str) -> Callable[[Planned, dict[str, Any]], str]:
    """The line a finished tuning run gets: its score."""

    def said(run: Planned, m: dict[str, Any]) -> str:
        v = m.get(metric)
        point = run.run_dir.parent.name
        return f"{run.name} {point} seed {run.seed}: {metric} " + ("n/a" if v is None else f"{v:.4f}")

    return said
