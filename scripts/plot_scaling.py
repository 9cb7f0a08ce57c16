"""A suite's metric against the number of clients: variants named ``<strategy>_n<N>`` (testbed-clients).

    python scripts/plot_scaling.py runs/compare-testbed-clients/compare.json --out docs/figures/rolora
    # last line: one JSON object (the plotted means and stds, by strategy and N)

One panel per metric (accuracy in points, held-out loss), mean +/- std over the suite's seeds.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path


def series(summary: dict, metric: str) -> dict[str, dict[int, tuple[float, float]]]:
    """``{strategy: {N: (mean, std)}}`` of ``metric`` over the seeds, from ``fedllm compare``'s JSON."""
    out: dict[str, dict[int, tuple[float, float]]] = {}
    for variant, by_seed in summary["per_seed"].items():
        m = re.fullmatch(r"(.+)_n(\d+)", variant)
        if not m:
            continue
        values = [row[metric] for row in by_seed.values() if row.get(metric) is not None]
        if len(values) < 2:
            continue
        out.setdefault(m.group(1), {})[int(m.group(2))] = (statistics.mean(values), statistics.stdev(values))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("summary", type=Path)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = json.loads(args.summary.read_text())
    panels = (("accuracy", "benchmark accuracy (points)", 100.0), ("heldout_loss", "held-out loss", 1.0))
    fig, axes = plt.subplots(1, len(panels), figsize=(10, 4))
    result = {}
    for ax, (metric, label, mul) in zip(axes, panels, strict=True):
        data = series(summary, metric)
        result[metric] = {s: {str(n): v for n, v in sorted(d.items())} for s, d in data.items()}
        for strategy, by_n in sorted(data.items()):
            ns = sorted(by_n)
            ax.errorbar(
                ns,
                [by_n[n][0] * mul for n in ns],
                yerr=[by_n[n][1] * mul for n in ns],
                marker="o",
                capsize=3,
                label=strategy,
            )
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({n for d in data.values() for n in d}))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_xlabel("clients (all in every round; local steps 240 / N)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{summary['config']}: mean +/- std over seeds {summary['seeds']}")
    fig.tight_layout()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "accuracy_loss_vs_clients.png"
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
