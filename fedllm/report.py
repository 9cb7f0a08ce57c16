"""``fedllm report``: compare runs in a table and two PNG plots.

Plots: accuracy against round, and accuracy against cumulative communication
(upload + download bytes), one line per run. The data behind each plot is
also written to ``report.json`` so it can be checked and re-plotted.
"""

from __future__ import annotations

import json
from pathlib import Path

from fedllm.checkpoint import atomic_write_text, read_jsonl


def load_run(run_dir: Path) -> dict:
    rows = read_jsonl(Path(run_dir) / "metrics.jsonl")
    if not rows:
        raise ValueError(f"{run_dir}: no metrics.jsonl rows (not a fedllm run directory, or no round finished)")
    summary_path = Path(run_dir) / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    evals = [r for r in rows if r.get("accuracy") is not None]
    comm = 0
    curve_comm = []
    for r in rows:
        comm += r.get("up_bytes", 0) + r.get("down_bytes", 0)
        if r.get("accuracy") is not None:
            curve_comm.append((comm, r["accuracy"]))
    last = rows[-1]
    return {
        "name": Path(run_dir).name,
        "strategy": summary.get("strategy", "?"),
        "final_accuracy": evals[-1]["accuracy"] if evals else None,
        "best_accuracy": max((r["accuracy"] for r in evals), default=None),
        "final_loss": next((r["eval_loss"] for r in reversed(rows) if r.get("eval_loss") is not None), None),
        "up_bytes": last.get("cumulative", {}).get("total_up_bytes", 0),
        "down_bytes": last.get("cumulative", {}).get("total_down_bytes", 0),
        "wall_s": summary.get("wall_s"),
        "accuracy_by_round": [(r["round"], r["accuracy"]) for r in evals],
        "accuracy_by_comm": curve_comm,
    }


def _fmt(x, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def table(runs: list[dict]) -> str:
    head = (f"{'run':<24} {'strategy':<9} {'final acc':>9} {'best acc':>9} {'loss':>8} {'up MB':>9} "
            f"{'down MB':>9} {'wall s':>8}")
    lines = [head, "-" * len(head)]
    for r in runs:
        lines.append(
            f"{r['name'][:24]:<24} {r['strategy']:<9} {_fmt(r['final_accuracy'], '.4f'):>9} "
            f"{_fmt(r['best_accuracy'], '.4f'):>9} {_fmt(r['final_loss'], '.4f'):>8} {r['up_bytes'] / 1e6:>9.2f} "
            f"{r['down_bytes'] / 1e6:>9.2f} {_fmt(r['wall_s'], '.1f'):>8}"
        )
    return "\n".join(lines)


def plot(runs: list[dict], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for key, xlabel, fname in (("accuracy_by_round", "round", "accuracy_vs_round.png"),
                               ("accuracy_by_comm", "cumulative communication (bytes, up + down)",
                                "accuracy_vs_communication.png")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for r in runs:
            xs, ys = zip(*r[key], strict=True) if r[key] else ((), ())
            ax.plot(xs, ys, marker="o", label=f"{r['name']} ({r['strategy']})")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("accuracy")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / fname
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


def report(run_dirs: list[Path], out_dir: Path | None = None) -> str:
    """Table text; writes the plots and report.json into ``out_dir`` (default: the first run)."""
    runs = [load_run(d) for d in run_dirs]
    out = Path(out_dir or run_dirs[0])
    out.mkdir(parents=True, exist_ok=True)
    paths = plot(runs, out)
    atomic_write_text(out / "report.json", json.dumps({"runs": runs, "plots": [str(p) for p in paths]}, indent=1))
    return table(runs) + "\n\nplots: " + ", ".join(str(p) for p in paths)
