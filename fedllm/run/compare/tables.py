"""A comparison's tables: the text summary, the corrected families as markdown, each variant's tuned value,
and the files a comparison writes (``compare.json``, ``compare.md``, ``compare.csv``, ``compare.png``)."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fedllm.run.compare.metrics import metric_format


def format_summary(summary: dict[str, Any], metrics: list[str] | None = None) -> str:
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
        scale, spec, unit = metric_format(metric)

        def num(x: float, signed: bool = False, scale: float = scale, spec: str = spec) -> str:
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


def format_corrected(summary: dict[str, Any], metrics: list[str] | None = None) -> str:
    """A markdown table per metric: each row's mean +/- std, its difference to the baseline and to the best
    federated row with the family-corrected interval and Holm's p, and a verdict only where the corrected
    interval excludes 0; then the smallest difference each family can detect."""
    out = []
    seeds = summary["seeds"]
    for metric, fam in summary.get("corrected", {}).items():
        if metrics and metric not in metrics:
            continue
        scale, spec, unit = metric_format(metric)

        def num(x: float, signed: bool = False, scale: float = scale, spec: str = spec) -> str:
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
        apart = fam.get("references_vs_baseline")  # the references' own (secondary) family
        by_ref = {c["name"]: c for c in apart["comparisons"]} if apart else {}
        by_best = {c["name"]: c for c in best["comparisons"]} if best else {}
        for name, e in summary["metrics"][metric].items():
            cells = [name, f"{num(e['mean'])} +/- {num(e['std'])}"]
            for by in (by_base, by_best) if best else (by_base,):
                c = by.get(name)
                secondary = c is None and by is by_base and name in by_ref
                if secondary:
                    c = by_ref[name]
                if c is None:
                    cells += ["(reference)", ""]
                    continue
                verdict = " **excludes 0**" if c["low"] > 0 or c["high"] < 0 else ""
                tag = f" (secondary, m = {apart['m']})" if secondary and apart else ""
                interval = f"[{num(c['low'], True)}, {num(c['high'], True)}]"
                cells += [f"{num(c['diff'], True)} {interval}{verdict}{tag}", f"{c['p_holm']:.3f}"]
            out.append("| " + " | ".join(cells) + " |")
        mdes = [f"vs {f['reference']}: {num(f['detectable'])}{unit}" for f in (base, best) if f]
        if apart:
            mdes.insert(1, f"references vs {apart['reference']}: {num(apart['detectable'])}{unit}")
        out.append(f"\nsmallest difference these seeds detect (80 % power): {'; '.join(mdes)}")
    return "\n".join(out)


def write_results(out_root: Path, summary: dict[str, Any]) -> None:
    """``compare.json`` (everything), ``compare.md`` (the table), ``compare.csv`` (one row per metric and
    variant) and ``compare.png`` (the corrected differences, ``plots.plot_corrected``; from 2 seeds) in the
    comparison's folder, each written atomically; with tuning, compare.md opens with each variant's chosen
    value (:func:`format_tuning`)."""
    import csv
    import io

    from fedllm.files import atomic_write_text

    out_root.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out_root / "compare.json", json.dumps(summary, indent=1))
    tuned = format_tuning(summary["tuning"]) + "\n" if summary.get("tuning") else ""
    atomic_write_text(
        out_root / "compare.md",
        tuned + "```\n" + format_summary(summary) + "\n```\n" + format_corrected(summary) + "\n",
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
    from fedllm.run.compare.plots import plot_corrected

    drawn(lambda: plot_corrected(summary, out_root / "compare.png"), "compare.png", "compare.md")


def drawn(draw: Callable[[], object], name: str, numbers: str) -> None:
    """Draw a figure; a drawing error is said in one line and costs the command none of its files (the
    figure is a view of the numbers in ``numbers``)."""
    try:
        draw()
    except Exception as exc:
        print(
            f"{name} not drawn ({type(exc).__name__}: {exc}); {numbers} holds the same numbers",
            file=sys.stderr,
        )


def format_tuning(tuning: dict[str, Any]) -> str:
    """Each variant's chosen value as markdown: the grid's mean score per point (over the tuning seeds), the
    point chosen, and one line where the choice sits at an edge of the grid it could not extend past."""
    metric, seeds = tuning["metric"], tuning["seeds"]
    scale, spec, _ = metric_format(metric)
    lines = [
        f"## Each variant's value, chosen on the validation split ({metric}, mean over tuning seeds {seeds}; "
        f"{'lower' if tuning['better'] < 0 else 'higher'} is better)",
        "",
        "| variant | chosen | grid: mean " + metric + " per point (chosen in bold) |",
        "|---|---|---|",
    ]
    for name, t in tuning["variants"].items():
        chosen = ", ".join(f"{k}={v}" for k, v in t["chosen"].items())
        cells = []
        for p in t["points"]:
            text = f"{p['tag']}: " + ("n/a" if p["mean"] is None else format(p["mean"] * scale, spec))
            cells.append(f"**{text}**" if p["tag"] == t["chosen_tag"] else text)
        lines.append(f"| {name} | {chosen} | {'; '.join(cells)} |")
    edges = [f"- {name}: {t['edge_note']}" for name, t in tuning["variants"].items() if t.get("edge_note")]
    if edges:
        lines += ["", *edges]
    drift = tuning.get("matched_drift") or {}
    if drift:
        base = next(iter(tuning["variants"]))
        lines += ["", f"At matched drift (general agreement), against {base}, over the agreement both reach "
                  "(descriptive):"]  # fmt: skip
        for name, d in drift.items():
            span = "" if d["range"] is None else f" over {d['range'][0]:.1f}-{d['range'][1]:.1f}"
            mean = f", mean difference {d['mean_diff'] * scale:+.4f}" if "mean_diff" in d else ""
            lines.append(f"- {name}: {d['reading']}{span}{mean}")
    return "\n".join(lines)
