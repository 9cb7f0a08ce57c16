"""``fedllm compare``: variants of one config over several seeds, with paired differences.

One run's number is one draw: the partition, the sampled clients, the
initialization and the local batches all come from ``federation.seed``, and
float kernels differ across machines. So a comparison runs every variant for
the same seeds (seed s gives every variant the same partition and the same
client draws) and reports, per metric, the mean +/- sample standard deviation
over seeds and, against the first variant, the mean of the per-seed
differences with a 95% Student-t interval. A difference whose interval holds
zero is reported as such, not as a win.

Runs land in ``OUT/<variant>/seed-<s>``, each with its log beside it
(``OUT/<variant>/seed-<s>.log``). A finished run is reused, and an interrupted
one continued, only if its resolved config (every key but ``output.*`` and
``flower.*``: evaluation included) and the fedllm version equal the requested
ones; otherwise the comparison stops before any run starts and names the keys
that differ (``--rerun`` runs such variants again in a fresh folder). A run of
the same config made by other code, data, model file, precision or libraries
(its identity, ``fedllm.run.identity``) is never reused: the comparison says in
one line what differs, moves the old run to ``OUT/.superseded/`` and runs it
again. The table and the JSON carry each variant's overrides and config
digest, and the identity that made every row.
``fedllm report OUT/*/seed-*`` plots each variant's mean with a band.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedllm import __version__
from fedllm.run.identity import differences, run_identity
from fedllm.run.reader import RunFolder

if TYPE_CHECKING:
    from matplotlib.figure import Figure

NOT_NUMBERS = ("output.", "flower.")  # config keys that change neither the trajectory nor the numbers


class StaleRun(ValueError):
    """A run folder holds a run of other settings than the comparison asks for."""


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
    "rouge_l": ("summary:rouge_l_after", "rouge"),
    "rouge_l_gain": ("gain:rouge_l", "rouge"),
    "general_agreement": ("summary:general_agreement_after", "rouge"),
    "client_acc_global": ("last:global_client_acc", "points"),
    "client_acc_personal": ("last:personal_acc", "points"),
    "up_params": ("comm:total_up_params", "count"),
    "down_params": ("comm:total_down_params", "count"),
    "up_mb": ("comm:total_up_bytes", "megabytes"),
    "down_mb": ("comm:total_down_bytes", "megabytes"),
    "wall_s": ("summary:wall_s", "seconds"),
    "client_loss_global": ("last:global_client_loss", "loss"),
    "client_loss_personal": ("last:personal_loss", "loss"),
    # the same, over the clients sampled at least once (one never sampled has its method's starting model)
    "client_loss_own_trained": ("own:personal_loss", "loss"),
}
# which way is better, for the metrics a table ranks rows by ("the best row"): +1 higher, -1 lower
BETTER = {
    "accuracy": 1,
    "accuracy_gain": 1,
    "heldout_loss": -1,
    "heldout_loss_drop": 1,
    "rouge_l": 1,
    "rouge_l_gain": 1,
    "client_acc_global": 1,
    "client_acc_personal": 1,
    "client_loss_global": -1,
    "client_loss_personal": -1,
    "client_loss_own_trained": -1,
    "down_mb": -1,
    "up_mb": -1,
}
FORMATS = {
    "points": (100.0, ".1f", " points"),
    "percent": (100.0, ".1f", " %"),
    "loss": (1.0, ".4f", ""),
    "rouge": (1.0, ".2f", ""),  # Rouge-L, already in percent
    "count": (1.0, ",.0f", ""),
    "megabytes": (1e-6, ".3f", " MB"),
    "seconds": (1.0, ".1f", " s"),
    "number": (1.0, ".3g", ""),  # a number a feature reports in the summary's ``metrics`` (e.g. its bound)
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


def numbers_config(cfg) -> dict[str, Any]:
    """The config keys that decide a run's numbers (all but :data:`NOT_NUMBERS`)."""
    from fedllm.config import flat_config

    return {k: v for k, v in flat_config(cfg).items() if not k.startswith(NOT_NUMBERS)}


def config_digest(cfg) -> str:
    """A short digest of :func:`numbers_config` and the fedllm version."""
    text = json.dumps({"config": numbers_config(cfg), "version": __version__}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def stale_reason(run_dir: Path, wanted) -> str | None:
    """Why the run in ``run_dir`` is not the one ``wanted`` describes (None: it is, or there is none)."""
    from fedllm.config import ConfigError

    run = RunFolder(run_dir)
    if not run.is_run():
        return None
    try:
        have = numbers_config(run.config())
    except ConfigError as e:
        return f"its config.yaml no longer loads ({e})"
    want = numbers_config(wanted)
    differ = sorted(k for k in set(have) | set(want) if have.get(k) != want.get(k))
    if differ:
        shown = ", ".join(f"{k}: {have.get(k)!r} there, {want.get(k)!r} asked" for k in differ[:4])
        return f"other settings ({shown}{', ...' if len(differ) > 4 else ''})"
    version = run.version()
    if version != __version__:
        return f"another fedllm version ({version or 'unknown'} there, {__version__} here)"
    return None


def settled(cfg):
    """``cfg`` with what a run settles before it starts settled the same way here (``auto`` mixed precision
    on this machine, the clip of a one-job run), so a finished run's config.yaml compares equal."""
    from fedllm.config import settle_clip
    from fedllm.model.precision import resolve

    resolve(cfg)
    settle_clip(cfg, organizations=False)
    return cfg


def supersede(out_root: Path, run_dir: Path) -> Path:
    """Move a run made by other code or data (and its log) out of the comparison, kept under
    ``OUT/.superseded/`` with the time it was moved; the new run takes its place."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    dest = out_root / ".superseded" / f"{run_dir.parent.name}-{run_dir.name}-{stamp}"
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(run_dir), str(dest))
    log = run_dir.with_name(run_dir.name + ".log")
    if log.exists():
        shutil.move(str(log), str(dest) + ".log")
    return dest


def common_identity(run_dirs: list[Path]) -> dict[str, Any] | None:
    """The identity every run in ``run_dirs`` shares (the first run's; the same means no part differs, as
    :func:`~fedllm.run.identity.differences` reads it: a commit that changed no source file is the same
    code), or None where they differ (or one has none)."""
    found = [RunFolder(d).identity() for d in run_dirs]
    if not found or found[0] is None:
        return None
    return found[0] if all(not differences(i, found[0]) for i in found) else None


def run_metrics(run_dir: Path) -> dict[str, float | None]:
    """The comparison metrics of one finished run (None where the run does not have them)."""
    run = RunFolder(run_dir)
    summary, rows = run.summary(), run.rows()
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
        elif kind == "own":  # the last personalized row's clients that were sampled at least once
            sampled = {str(k) for r in rows for k in r.get("sampled", [])}
            own = next((r["personal"] for r in reversed(rows) if r.get("personal")), {})
            vals = [v[key] for k, v in own.items() if k in sampled and v.get(key) is not None]
            out[name] = sum(vals) / len(vals) if vals else None
        elif kind == "drop":  # relative fall, 1 - after / before
            a, b = summary.get(f"{key}_after"), summary.get(f"{key}_before")
            out[name] = None if a is None or not b else 1 - a / b
    out.update(summary.get("metrics", {}))  # what a feature reports (a guarantee's bound, ...)
    return out


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
) -> dict[str, Any]:
    """One metric's two families of paired comparisons, each corrected for its own size
    (``fedllm.run.stats``): every other row against ``base``, and (where the metric has a better
    direction) every other federated row against the best federated one (``references``, e.g. local-only
    and centralized, are never "the best"); with the smallest difference each family can detect (80 %
    power, from the median spread of its per-seed differences)."""
    from fedllm.run.stats import correct, detectable, paired_test

    def family(ref: str, names: list[str]) -> dict[str, Any]:
        comps = correct([paired_test(n, per_seed[n], per_seed[ref]) for n in names], alpha)
        sds = [c.sd for c in comps if math.isfinite(c.sd)]
        n = min((c.n for c in comps), default=0)
        mde = detectable(statistics.median(sds), n, len(comps), alpha) if sds else math.nan
        return {"reference": ref, "m": len(comps), "detectable": mde, "comparisons": [vars(c) for c in comps]}

    out: dict[str, Any] = {"vs_baseline": family(base, [n for n in per_seed if n != base])}
    federated = [n for n in per_seed if n not in references]
    if better is not None and len(federated) > 1:
        best = max(federated, key=lambda n: better * statistics.fmean(per_seed[n]))
        out["vs_best"] = family(best, [n for n in per_seed if n != best])
    return out


def summarize(
    results: dict[str, dict[int, dict[str, float | None]]], references: list[str] | None = None
) -> dict:
    """Per metric: every variant's mean/std and its paired difference to the first variant (95 %, each on its
    own), and the corrected families of :func:`corrected` (over the seeds every variant has)."""
    names = list(results)
    base = names[0]
    seeds = sorted(set.intersection(*(set(r) for r in results.values())))
    table: dict = {}
    families: dict = {}
    reported = [m for r in results.values() for per_seed in r.values() for m in per_seed]
    for metric in dict.fromkeys([*METRICS, *reported]):  # the built-in metrics first, then the features'
        per = {}
        for name in names:
            vals = [results[name][s].get(metric) for s in seeds]  # (a metric some runs lack: skipped)
            if any(v is None for v in vals):
                continue
            entry = describe(vals)
            if METRICS.get(metric, ("",))[0].split(":")[0] in ("gain", "drop"):
                # a within-run change (after vs before round 1): paired by construction, its own interval
                entry["vs_before"] = paired(vals, [0.0] * len(vals))
            base_vals = [results[base][s].get(metric) for s in seeds]
            if name != base and not any(v is None for v in base_vals):
                entry["vs_" + base] = paired(vals, base_vals)
            per[name] = entry
        if per:
            table[metric] = per
            full = {n: [float(results[n][s][metric]) for s in seeds] for n in per}  # type: ignore[arg-type]
            if len(full) > 1 and base in full and len(seeds) > 1:
                families[metric] = corrected(full, base, references or [], BETTER.get(metric))
    return {"baseline": base, "seeds": seeds, "metrics": table, "corrected": families}


def format_summary(summary: dict, metrics: list[str] | None = None) -> str:
    """A text table: mean +/- std per variant and the paired difference with its 95% interval."""
    base = summary["baseline"]
    lines = [
        f"seeds {summary['seeds']}; differences are paired per seed against '{base}', with 95% t intervals"
    ]
    if "variants" in summary:
        common = " ".join(summary.get("common_overrides") or [])
        lines.append(
            f"config {summary.get('config') or 'built-in default'}" + (f" + {common}" if common else "")
        )
    for name, overrides in summary.get("variants", {}).items():
        digest = summary.get("config_digests", {}).get(name, "")
        lines.append(f"  {name:<14} {' '.join(overrides) or '(no overrides)'}  [config {digest}]")
    for metric, per in summary["metrics"].items():
        if metrics and metric not in metrics:
            continue
        scale, spec, unit = FORMATS[METRICS.get(metric, ("", "number"))[1]]

        def num(x: float, signed: bool = False, scale=scale, spec=spec) -> str:
            return "n/a" if math.isnan(x) else format(x * scale, ("+" if signed else "") + spec)

        lines.append(f"\n{metric}")
        for name, e in per.items():
            text = f"  {name:<14} {num(e['mean'])} +/- {num(e['std'])}{unit}"
            d = e.get(f"vs_{base}")
            if d is not None and d["low"] == d["high"]:  # the same difference on every seed
                text += (
                    "   the same on every seed"
                    if d["diff"] == 0
                    else f"   diff {num(d['diff'], True)}{unit} on every seed (no variance)"
                )
            elif d is not None:
                verdict = "" if d["excludes_zero"] else "  (interval holds 0: no difference shown)"
                low, high = num(d["low"], True), num(d["high"], True)
                text += f"   diff {num(d['diff'], True)}{unit} [{low}, {high}]{verdict}"
            own = e.get("vs_before")  # a change within each run: its 95% t interval over the seeds
            if own is not None and not math.isnan(own["low"]):
                low, high = num(own["low"], True), num(own["high"], True)
                text += f"   95% interval [{low}, {high}]" + ("" if own["excludes_zero"] else " (holds 0)")
            lines.append(text)
    return "\n".join(lines)


def format_corrected(summary: dict, metrics: list[str] | None = None) -> str:
    """A markdown table per metric: each row's mean +/- std, its difference to the baseline and to the best
    federated row with the family-corrected interval and Holm's p, and a verdict only where the corrected
    interval excludes 0; then the smallest difference each family can detect."""
    out = []
    seeds = summary["seeds"]
    for metric, fam in summary.get("corrected", {}).items():
        if metrics and metric not in metrics:
            continue
        scale, spec, unit = FORMATS[METRICS.get(metric, ("", "number"))[1]]

        def num(x: float, signed: bool = False, scale=scale, spec=spec) -> str:
            return "n/a" if not math.isfinite(x) else format(x * scale, ("+" if signed else "") + spec)

        base = fam["vs_baseline"]
        best = fam.get("vs_best")
        head = f"| {metric}{unit} | mean +/- std | vs {base['reference']} (m = {base['m']}) | Holm p |"
        rule = "|---|---|---|---|"
        if best:
            head += f" vs best: {best['reference']} (m = {best['m']}) | Holm p |"
            rule += "---|---|"
        out += [
            f"\n{metric} over seeds {seeds}: intervals at 1 - 0.05 / m (Bonferroni, per family); a verdict "
            "only where that interval excludes 0 (a Holm p below 0.05 can stand without one); the best row "
            "is chosen on these same seeds, so its family describes the gaps, it does not test them",
            head,
            rule,
        ]
        by_base = {c["name"]: c for c in base["comparisons"]}
        by_best = {c["name"]: c for c in best["comparisons"]} if best else {}
        for name, e in summary["metrics"][metric].items():
            cells = [name, f"{num(e['mean'])} +/- {num(e['std'])}"]
            for by in (by_base, by_best) if best else (by_base,):
                c = by.get(name)
                if c is None:
                    cells += ["(reference)", ""]
                    continue
                verdict = " **excludes 0**" if c["low"] > 0 or c["high"] < 0 else ""
                cells += [f"{num(c['diff'], True)} [{num(c['low'], True)}, {num(c['high'], True)}]{verdict}",
                          f"{c['p_holm']:.3f}"]  # fmt: skip
            out.append("| " + " | ".join(cells) + " |")
        mdes = [f"vs {f['reference']}: {num(f['detectable'])}{unit}" for f in (base, best) if f]
        out.append(f"\nsmallest difference these seeds detect (80 % power): {'; '.join(mdes)}")
    return "\n".join(out)


def _run_one(
    config: str | None, variant: Variant, seed: int, run_dir: Path, threads: int, extra: list[str]
) -> tuple[Path, float]:
    """One run (continued if interrupted, skipped if finished: checked equal beforehand); its output goes
    to ``<run_dir>.log``. Returns the folder and the seconds it took here."""
    t0 = time.perf_counter()
    if RunFolder(run_dir).is_finished():  # finished earlier with these settings: reuse
        return run_dir, 0.0
    cmd = [sys.executable, "-m", "fedllm.cli", "--log-level", "INFO", "run", "--output-dir", str(run_dir)]
    if config:
        cmd += ["--config", config]
    if RunFolder(run_dir).is_run():  # interrupted earlier with these settings: continue it
        cmd = [sys.executable, "-m", "fedllm.cli", "--log-level", "INFO", "run", "--resume", str(run_dir)]
    else:
        cmd += [*extra, *variant.overrides, f"federation.seed={seed}"]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}  # float results depend on the thread count
    # the runs import the fedllm this comparison checked identities against, whatever the working folder holds
    code = str(Path(importlib.import_module("fedllm").__file__ or "").parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([code, *filter(None, [os.environ.get("PYTHONPATH")])])
    log_path = run_dir.with_name(run_dir.name + ".log")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a") as log:
        out = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    if out.returncode != 0:
        tail = log_path.read_text().strip().splitlines()[-1:] or [""]
        raise RuntimeError(
            f"variant {variant.name} seed {seed} failed (exit {out.returncode}): {tail[0]} (log: {log_path})"
        )
    return run_dir, time.perf_counter() - t0


def _build_bases(config: str | None, variants: list[Variant], extra: list[str]) -> None:
    """Build the built-in base once here, rather than once in each of the first parallel runs."""
    from fedllm.config import load_config
    from fedllm.model.modeling import resolve_model_path

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
    rerun: bool = False,
    progress: bool = True,
    references: list[str] | None = None,
) -> dict:
    """Run every variant for every seed (``jobs`` at a time) and summarize; see the module docstring."""
    from tqdm.auto import tqdm

    from fedllm.config import load_config

    if not variants:
        raise ValueError("give at least one --variant")
    if len({v.name for v in variants}) != len(variants):
        raise ValueError("variant names must be distinct")
    extra = extra or []
    threads = max(1, (os.cpu_count() or 1) // max(1, jobs))
    tasks = [(v, s) for s in seeds for v in variants]
    digests: dict[str, str] = {}
    stale: list[str] = []
    _build_bases(config, variants, extra)
    identities: dict[str, dict[str, Any]] = {}
    for v, s in tasks:  # every folder checked before the first run starts
        run_dir = out_root / v.name / f"seed-{s}"
        wanted = settled(load_config(config, [*extra, *v.overrides, f"federation.seed={s}"]))
        digests.setdefault(v.name, config_digest(settled(load_config(config, [*extra, *v.overrides]))))
        why = stale_reason(run_dir, wanted)
        if why is not None:
            if not rerun:
                stale.append(f"{run_dir}: {why}")
            else:
                shutil.rmtree(run_dir)
                run_dir.with_name(run_dir.name + ".log").unlink(missing_ok=True)
        elif RunFolder(run_dir).is_run():
            if v.name not in identities:
                identities[v.name] = run_identity(wanted)
            differ = differences(RunFolder(run_dir).identity(), identities[v.name])
            if differ:
                moved = supersede(out_root, run_dir)
                said = "; ".join(differ)
                print(f"{v.name} seed {s}: made by other code or data ({said}): running it again (the old "
                      f"run moved to {moved})", file=sys.stderr)  # fmt: skip
    if stale:
        raise StaleRun(
            "these folders hold runs of other settings than asked (pass --rerun to run them again, or "
            "choose another --output-dir):\n  " + "\n  ".join(stale)
        )
    results: dict[str, dict[int, dict]] = {v.name: {} for v in variants}
    bar = tqdm(total=len(tasks), desc="runs", unit="run", disable=not progress)
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = {
            pool.submit(_run_one, config, v, s, out_root / v.name / f"seed-{s}", threads, extra): (v, s)
            for v, s in tasks
        }
        for fut in as_completed(futures):
            (v, s), (run_dir, took) = futures[fut], fut.result()
            results[v.name][s] = m = run_metrics(run_dir)
            acc = "n/a" if m.get("accuracy") is None else f"{m['accuracy']:.4f}"
            loss = "n/a" if m.get("heldout_loss") is None else f"{m['heldout_loss']:.4f}"
            own = "" if m.get("wall_s") is None else f"run {m['wall_s']:.0f} s"
            bar.write(
                f"{v.name} seed {s}: accuracy {acc}, held-out loss {loss}, "
                + (f"{own}, {took:.0f} s with start-up" if took else f"{own}, reused (same settings)"),
                file=sys.stderr,
            )
            bar.update()
    bar.close()
    summary = summarize({v.name: dict(sorted(results[v.name].items())) for v in variants}, references)
    summary.update(
        {
            "config": config,
            "common_overrides": extra,
            "variants": {v.name: v.overrides for v in variants},
            "references": references or [],
            "config_digests": digests,
            "fedllm_version": __version__,
            "identity": common_identity([out_root / v.name / f"seed-{s}" for v in variants for s in seeds]),
            "threads_per_run": threads,
            "runs": {v.name: {str(s): str(out_root / v.name / f"seed-{s}") for s in seeds} for v in variants},
            "per_seed": {k: {str(s): m for s, m in sorted(r.items())} for k, r in results.items()},
        }
    )
    write_results(out_root, summary)
    return summary


def write_results(out_root: Path, summary: dict) -> None:
    """``compare.json`` (everything), ``compare.md`` (the table), ``compare.csv`` (one row per metric and
    variant) and ``compare.png`` (the corrected differences, :func:`plot_corrected`;
    from 2 seeds) in the comparison's folder, each written atomically."""
    import csv
    import io

    from fedllm.files import atomic_write_text

    out_root.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out_root / "compare.json", json.dumps(summary, indent=1))
    atomic_write_text(
        out_root / "compare.md",
        "```\n" + format_summary(summary) + "\n```\n" + format_corrected(summary) + "\n",
    )
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(
        ["metric", "variant", "mean", "std", "n", "diff", "low_95", "high_95", "excludes_zero_uncorrected"]
    )
    base = summary["baseline"]
    for metric, per in summary["metrics"].items():
        for name, e in per.items():
            d = e.get(f"vs_{base}") or {}
            w.writerow(
                [
                    metric,
                    name,
                    e["mean"],
                    e["std"],
                    e["n"],
                    *(d.get(k, "") for k in ("diff", "low", "high", "excludes_zero")),
                ]
            )
    atomic_write_text(out_root / "compare.csv", buf.getvalue())
    try:  # the figure is a view of the files above: a drawing error must not cost the command its output
        plot_corrected(summary, out_root / "compare.png")
    except Exception as exc:
        print(
            f"compare.png not drawn ({type(exc).__name__}: {exc}); compare.md holds the same numbers",
            file=sys.stderr,
        )


def plot_corrected(
    summary: dict[str, Any], path: Path, metrics: list[str] | None = None, references: list[str] | None = None
) -> Path | None:
    """Draw :func:`corrected_figure` into ``path`` (PNG, written atomically); None when it has no panel
    (and then no older figure is left at ``path`` to be read as this comparison's)."""
    import io

    import matplotlib.pyplot as plt

    from fedllm.files import atomic_write_bytes

    fig = corrected_figure(summary, metrics, references)
    if fig is None:
        Path(path).unlink(missing_ok=True)
        return None
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=150)
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
    return path


def corrected_figure(
    summary: dict[str, Any], metrics: list[str] | None = None, references: list[str] | None = None
) -> Figure | None:
    """The corrected families of a comparison (``fedllm.run.compare.summarize``) as one forest plot: per
    metric (in ``metrics``' order; default: every metric with a better direction), every row's paired
    difference to the baseline with its family-corrected (Bonferroni) interval, 0 marked, and a band of
    the smallest difference the design detects at 80 % power.

    Why a figure: the table's verdict is "an interval excludes 0", and a reader sees at a glance which do,
    how far from 0 the others reach, and whether a difference that holds 0 could still be a large one the
    seeds cannot resolve (an interval wider than the band). Filled markers: the interval excludes 0; grey:
    a reference row (local-only, centralized, ...). None when no family has an interval (fewer than 2
    seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    corrected = summary.get("corrected", {})
    # by default the metrics a row can be better on (not run time, parameter counts or a feature's numbers)
    order = [m for m in (metrics or [m for m in corrected if m in BETTER]) if m in corrected]
    families = {
        m: corrected[m]["vs_baseline"]
        for m in order
        if any(math.isfinite(c["low"]) for c in corrected[m]["vs_baseline"]["comparisons"])
    }
    if not families:
        return None
    refs = set(references if references is not None else summary.get("references") or [])
    heights = [0.6 + 0.26 * len(f["comparisons"]) for f in families.values()]
    fig, axes = plt.subplots(
        len(families),
        1,
        figsize=(6.4, sum(heights) + 0.6),
        gridspec_kw={"height_ratios": heights},
        squeeze=False,
    )
    for ax, (metric, fam) in zip(axes[:, 0], families.items(), strict=True):
        scale, _, unit = FORMATS[METRICS.get(metric, ("", "number"))[1]]
        comps = fam["comparisons"]
        ys = list(range(len(comps)))[::-1]
        mde = fam.get("detectable", math.nan)
        if math.isfinite(mde) and mde > 0:
            ax.axvspan(-mde * scale, mde * scale, color="0.9", zorder=0)
        ax.axvline(0.0, color="0.3", lw=0.8)
        for y, c in zip(ys, comps, strict=True):
            if not math.isfinite(c["low"]):
                ax.text(0.0, y, " n/a", va="center", fontsize=7, color="0.4")
                continue
            colour = "0.55" if c["name"] in refs else "C0"
            filled = c["low"] > 0 or c["high"] < 0
            ax.errorbar(
                c["diff"] * scale,
                y,
                xerr=[[(c["diff"] - c["low"]) * scale], [(c["high"] - c["diff"]) * scale]],
                fmt="o",
                color=colour,
                mfc=colour if filled else "white",
                capsize=2,
                ms=4,
                lw=1,
            )
        ax.set_yticks(ys, [c["name"] + (" (ref.)" if c["name"] in refs else "") for c in comps], fontsize=7)
        ax.set_ylim(-0.7, len(comps) - 0.3)
        level = 100 * (1 - 0.05 / fam["m"])
        better = {1: "  (higher is better)", -1: "  (lower is better)"}.get(BETTER.get(metric, 0), "")
        ax.set_title(
            f"{metric}{f' ({unit.strip()})' if unit else ''}: minus {fam['reference']}, "
            f"{level:.1f} % intervals (m = {fam['m']}){better}",
            fontsize=8,
        )
        ax.tick_params(axis="x", labelsize=7)
        ax.grid(axis="x", alpha=0.3)
    seeds = summary.get("seeds", [])
    fig.suptitle(
        f"Paired differences over seeds {seeds}\nfilled: the corrected interval excludes 0; "
        "shaded: within the smallest difference these seeds detect",
        fontsize=8,
    )
    fig.tight_layout(rect=(0.0, 0.0, 1.0, 1.0 - 0.45 / fig.get_figheight()))  # room for the two-line title
    return fig
