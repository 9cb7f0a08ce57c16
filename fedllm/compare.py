"""``fedllm compare``: variants of one config over several seeds, with paired differences.

One run's number is one draw: the partition, the sampled clients, the
initialization and the local batches all come from ``federation.seed``, and
float kernels differ across machines. So a comparison runs every variant for
the same seeds (seed s gives every variant the same partition and the same
client draws) and reports, per metric, the mean +/- sample standard deviation
over seeds and, against the first variant, the mean of the per-seed
differences with a 95% Student-t interval. A difference whose interval holds
zero is reported as such, not as a win.

Runs land in ``OUT/<variant>/seed-<s>`` (complete runs are reused, so an
interrupted comparison continues); ``fedllm report OUT/*/seed-*`` plots each
variant's mean with a band.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

# two-sided 95% quantiles of Student's t, by degrees of freedom (1..30); 1.96 beyond
_T975 = (
    12.706,
    4.303,
    3.182,
    2.776,
    2.571,
    2.447,
    2.365,
    2.306,
    2.262,
    2.228,
    2.201,
    2.179,
    2.160,
    2.145,
    2.131,
    2.120,
    2.110,
    2.101,
    2.093,
    2.086,
    2.080,
    2.074,
    2.069,
    2.064,
    2.060,
    2.056,
    2.052,
    2.048,
    2.045,
    2.042,
)

# metric name -> (where it is read, how it is printed: accuracies in points, counts with separators)
METRICS = {
    "accuracy": ("summary:accuracy_after", "points"),
    "accuracy_gain": ("gain:accuracy", "points"),
    "heldout_loss": ("summary:loss_after", "loss"),
    "heldout_loss_drop": ("drop:loss", "percent"),
    "client_acc_global": ("last:global_client_acc", "points"),
    "client_acc_personal": ("last:personal_acc", "points"),
    "up_params": ("comm:total_up_params", "count"),
    "down_params": ("comm:total_down_params", "count"),
    "wall_s": ("summary:wall_s", "seconds"),
}
FORMATS = {
    "points": (100.0, ".1f", " points"),
    "percent": (100.0, ".1f", " %"),
    "loss": (1.0, ".4f", ""),
    "count": (1.0, ",.0f", ""),
    "seconds": (1.0, ".1f", " s"),
}


def t_quantile(df: int) -> float:
    """The 0.975 quantile of Student's t with ``df`` degrees of freedom."""
    return _T975[df - 1] if 1 <= df <= len(_T975) else 1.96


@dataclass
class Variant:
    name: str
    overrides: list[str] = field(default_factory=list)


def parse_variant(text: str) -> Variant:
    """``name`` or ``name:key=value,key=value`` (a value may not contain a comma: use a config file for
    lists).
    """
    name, _, rest = text.partition(":")
    if not name.isidentifier():
        raise ValueError(
            f"--variant {text!r}: the name before ':' must be an identifier, "
            "e.g. fedit:aggregation.name=fedit"
        )
    overrides = [o for o in rest.split(",") if o] if rest else []
    for o in overrides:
        if "=" not in o:
            raise ValueError(f"--variant {text!r}: {o!r} is not key=value")
    return Variant(name, overrides)


def run_metrics(run_dir: Path) -> dict[str, float | None]:
    """The comparison metrics of one finished run (None where the run does not have them)."""
    from fedllm.checkpoint import read_jsonl

    summary = json.loads((run_dir / "summary.json").read_text())
    rows = read_jsonl(run_dir / "metrics.jsonl")
    last = next((r for r in reversed(rows) if "eval_loss" in r or "accuracy" in r), rows[-1] if rows else {})
    out: dict[str, float | None] = {}
    for name, (where, _) in METRICS.items():
        kind, _, key = where.partition(":")
        if kind == "summary":
            out[name] = summary.get(key)
        elif kind == "last":
            out[name] = last.get(key)
        elif kind == "comm":
            out[name] = summary.get("communication", {}).get(key)
        elif kind == "gain":  # after minus before
            a, b = summary.get(f"{key}_after"), summary.get(f"{key}_before")
            out[name] = None if a is None or b is None else a - b
        elif kind == "drop":  # relative fall, 1 - after / before
            a, b = summary.get(f"{key}_after"), summary.get(f"{key}_before")
            out[name] = None if a is None or not b else 1 - a / b
    return out


def describe(values: list[float]) -> dict[str, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "n": len(values),
    }


def paired(values: list[float], baseline: list[float]) -> dict[str, float | bool]:
    """Mean per-seed difference to the baseline, with its 95% t interval."""
    diffs = [v - b for v, b in zip(values, baseline, strict=True)]
    mean = statistics.fmean(diffs)
    if len(diffs) < 2:
        return {"diff": mean, "low": math.nan, "high": math.nan, "excludes_zero": False}
    half = t_quantile(len(diffs) - 1) * statistics.stdev(diffs) / math.sqrt(len(diffs))
    return {
        "diff": mean,
        "low": mean - half,
        "high": mean + half,
        "excludes_zero": mean - half > 0 or mean + half < 0,
    }


def summarize(results: dict[str, dict[int, dict[str, float | None]]]) -> dict:
    """Per metric: every variant's mean/std and its paired difference to the first variant."""
    names = list(results)
    base = names[0]
    seeds = sorted(set.intersection(*(set(r) for r in results.values())))
    table: dict = {}
    for metric in METRICS:
        per = {}
        for name in names:
            vals = [results[name][s][metric] for s in seeds]
            if any(v is None for v in vals):
                continue
            entry = describe(vals)
            base_vals = [results[base][s][metric] for s in seeds]
            if name != base and not any(v is None for v in base_vals):
                entry["vs_" + base] = paired(vals, base_vals)
            per[name] = entry
        if per:
            table[metric] = per
    return {"baseline": base, "seeds": seeds, "metrics": table}


def format_summary(summary: dict, metrics: list[str] | None = None) -> str:
    """A text table: mean +/- std per variant and the paired difference with its 95% interval."""
    base = summary["baseline"]
    lines = [
        f"seeds {summary['seeds']}; differences are paired per seed against '{base}', with 95% t intervals"
    ]
    for metric, per in summary["metrics"].items():
        if metrics and metric not in metrics:
            continue
        scale, spec, unit = FORMATS[METRICS[metric][1]]

        def num(x: float, signed: bool = False, scale=scale, spec=spec) -> str:
            return "n/a" if math.isnan(x) else format(x * scale, ("+" if signed else "") + spec)

        lines.append(f"\n{metric}")
        for name, e in per.items():
            text = f"  {name:<14} {num(e['mean'])} +/- {num(e['std'])}{unit}"
            d = e.get(f"vs_{base}")
            if d is not None:
                verdict = "" if d["excludes_zero"] else "  (interval holds 0: no difference shown)"
                low, high = num(d["low"], True), num(d["high"], True)
                text += f"   diff {num(d['diff'], True)}{unit} [{low}, {high}]{verdict}"
            lines.append(text)
    return "\n".join(lines)


def _run_one(
    config: str | None, variant: Variant, seed: int, run_dir: Path, threads: int, extra: list[str]
) -> Path:
    if (
        run_dir / "summary.json"
    ).exists():  # finished earlier: reuse (the run is deterministic on this machine)
        return run_dir
    cmd = [sys.executable, "-m", "fedllm.cli", "--log-level", "WARNING", "run", "--output-dir", str(run_dir)]
    if config:
        cmd += ["--config", config]
    if (run_dir / "config.yaml").exists():  # interrupted earlier: continue it
        cmd = [sys.executable, "-m", "fedllm.cli", "--log-level", "WARNING", "run", "--resume", str(run_dir)]
    else:
        cmd += [*extra, *variant.overrides, f"federation.seed={seed}"]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}  # float results depend on the thread count
    out = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if out.returncode != 0:
        raise RuntimeError(
            f"variant {variant.name} seed {seed} failed (exit {out.returncode}): "
            f"{out.stderr.strip().splitlines()[-1] if out.stderr.strip() else ''}"
        )
    return run_dir


def _build_bases(config: str | None, variants: list[Variant], extra: list[str]) -> None:
    """Build the built-in base once here, rather than once in each of the first parallel runs."""
    from fedllm.config import load_config
    from fedllm.modeling import resolve_model_path

    for cfg in {
        (c.model.name, c.model.builtin_pretrain_steps): c
        for c in (load_config(config, [*extra, *v.overrides]) for v in variants)
    }.values():
        resolve_model_path(cfg.model.name, cfg.model.builtin_pretrain_steps)


def compare(
    config: str | None,
    variants: list[Variant],
    seeds: list[int],
    out_root: Path,
    jobs: int = 1,
    extra: list[str] | None = None,
) -> dict:
    """Run every variant for every seed (``jobs`` at a time) and summarize; see the module docstring."""
    if not variants:
        raise ValueError("give at least one --variant")
    if len({v.name for v in variants}) != len(variants):
        raise ValueError("variant names must be distinct")
    threads = max(1, (os.cpu_count() or 1) // max(1, jobs))
    _build_bases(config, variants, extra or [])
    tasks = [(v, s) for s in seeds for v in variants]
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        dirs = list(
            pool.map(
                lambda t: _run_one(
                    config, t[0], t[1], out_root / t[0].name / f"seed-{t[1]}", threads, extra or []
                ),
                tasks,
            )
        )
    results: dict[str, dict[int, dict]] = {v.name: {} for v in variants}
    for (v, s), d in zip(tasks, dirs, strict=True):
        results[v.name][s] = run_metrics(d)
    summary = summarize(results)
    summary.update(
        {
            "config": config,
            "variants": {v.name: v.overrides for v in variants},
            "threads_per_run": threads,
            "runs": {v.name: {str(s): str(out_root / v.name / f"seed-{s}") for s in seeds} for v in variants},
            "per_seed": {k: {str(s): m for s, m in r.items()} for k, r in results.items()},
        }
    )
    return summary
