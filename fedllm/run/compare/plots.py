"""A comparison's figures: the corrected paired differences (a forest plot per metric) and, where variants
were tuned, each one's score against its drift over its whole grid (the matched-drift view)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedllm.run.compare.metrics import BETTER, metric_format
from fedllm.run.compare.summary import drift_curve

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def save_figure(fig: Figure, path: Path) -> Path:
    """``fig`` as a PNG at ``path``, written atomically, and closed."""
    import io

    import matplotlib.pyplot as plt

    from fedllm.files import atomic_write_bytes

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=150)
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
    return path


def plot_corrected(
    summary: dict[str, Any], path: Path, metrics: list[str] | None = None, references: list[str] | None = None
) -> Path | None:
    """Draw :func:`corrected_figure` into ``path`` (PNG, written atomically); None when it has no panel
    (and then no older figure is left at ``path`` to be read as this comparison's)."""
    fig = corrected_figure(summary, metrics, references)
    if fig is None:
        Path(path).unlink(missing_ok=True)
        return None
    return save_figure(fig, path)


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
        scale, _, unit = metric_format(metric)
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


def drift_figure(tuning: dict[str, Any], drift: str = "general_agreement", title: str = "") -> Figure | None:
    """Each tuned variant's score (the tuning metric, e.g. the validation loss) against its drift (e.g. its
    agreement with the base's answers to general prompts) at every point of its grid, means over the tuning
    seeds, joined in the grid's order, the chosen point ringed.

    Why: a method that moves further (a higher rate, an aggregate that shrinks less) can gain on the task
    and lose the base's general behaviour at once; two methods are compared fairly where their drift is
    equal, so a curve below another across the agreement both reach is a method better at matched drift,
    whatever rate each needed. None when no variant has both numbers at two points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metric = tuning["metric"]
    curves = {name: drift_curve(t, drift) for name, t in tuning["variants"].items()}
    curves = {name: c for name, c in curves.items() if len(c) >= 2}
    if not curves:
        return None
    scale, _, unit = metric_format(metric)
    dscale, _, dunit = metric_format(drift)
    fig, ax = plt.subplots(figsize=(6.4, 4.6))
    for i, (name, pts) in enumerate(curves.items()):
        colour = f"C{i % 10}"
        xs = [p["x"] * dscale for p in pts]
        ys = [p["y"] * scale for p in pts]
        ax.plot(xs, ys, "-o", color=colour, ms=3, lw=1, label=name)
        chosen = tuning["variants"][name]["chosen_tag"]
        for p, x, y in zip(pts, xs, ys, strict=True):
            if p["tag"] == chosen:
                ax.plot([x], [y], "o", ms=9, mfc="none", mec=colour, mew=1.5)
        first, last = pts[0], pts[-1]
        ax.annotate(first["short"], (xs[0], ys[0]), fontsize=6, color=colour, xytext=(2, 2),
                    textcoords="offset points")  # fmt: skip
        ax.annotate(last["short"], (xs[-1], ys[-1]), fontsize=6, color=colour, xytext=(2, 2),
                    textcoords="offset points")  # fmt: skip
    better = "lower" if BETTER.get(metric, -1) < 0 else "higher"
    ax.set_xlabel(f"{drift}{f' ({dunit.strip()})' if dunit.strip() else ''}: agreement with the base (100 = "
                  "unchanged)")  # fmt: skip
    ax.set_ylabel(f"{metric}{f' ({unit.strip()})' if unit.strip() else ''} ({better} is better)")
    ax.set_title(
        (title + "\n" if title else "")
        + "each variant over its grid (means over the tuning seeds all its points ran); ringed: chosen; "
        "the grid's first and last points labelled",
        fontsize=8,
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return fig


def plot_drift(tuning: dict[str, Any], path: Path, title: str = "") -> Path | None:
    """:func:`drift_figure` into ``path`` (PNG); None (and no stale figure left) when there is none."""
    fig = drift_figure(tuning, title=title)
    if fig is None:
        Path(path).unlink(missing_ok=True)
        return None
    return save_figure(fig, path)
