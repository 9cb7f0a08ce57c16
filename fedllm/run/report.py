"""``fedllm report``: compare runs in a table and PNG plots.

Runs that differ only in ``federation.seed`` are one *group* (seeds of one
variant, e.g. ``fedllm compare``'s ``OUT/<variant>/seed-<s>``): the table gives
their mean +/- std and each plot their mean with a +/- std band, because one
seed's curve is one draw. Plots: benchmark accuracy against round, accuracy
against cumulative communication (upload + download bytes) and held-out loss
against round (the one figure every run has, whatever its benchmark). The
data behind each plot is written to ``report.json`` so it can be checked and
re-plotted.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from fedllm.files import atomic_write_text
from fedllm.run.reader import RunFolder


def load_run(run_dir: Path) -> dict:
    run = RunFolder(run_dir)
    rows = run.rows()
    if not rows:
        raise ValueError(
            f"{run_dir}: no metrics.jsonl rows (not a fedllm run directory, or no round finished)"
        )
    summary, config = run.summary(), run.raw_config
    evals = [r for r in rows if r.get("accuracy") is not None]
    comm = 0
    curve_comm = []
    for r in rows:
        comm += r.get("up_bytes", 0) + r.get("down_bytes", 0)
        if r.get("accuracy") is not None:
            curve_comm.append((comm, r["accuracy"]))
    last = rows[-1]
    personal = [x for x in rows if x.get("personal_acc") is not None]
    return {
        "name": Path(run_dir).name,
        "dir": str(run_dir),
        "strategy": summary.get("strategy", config.get("aggregation", {}).get("name", "?")),
        "benchmark": summary.get("benchmark", config.get("eval", {}).get("benchmark")),
        "seed": config.get("federation", {}).get("seed"),
        "config": config,
        "settings": _settings(run, config),
        "final_accuracy": evals[-1]["accuracy"] if evals else None,
        "best_accuracy": max((r["accuracy"] for r in evals), default=None),
        "final_loss": next((r["eval_loss"] for r in reversed(rows) if r.get("eval_loss") is not None), None),
        "up_bytes": last.get("cumulative", {}).get("total_up_bytes", 0),
        "down_bytes": last.get("cumulative", {}).get("total_down_bytes", 0),
        "wall_s": summary.get("wall_s"),
        "rounds": summary.get("rounds_done", last.get("round")),
        "local_steps": config.get("client", {}).get("local_steps"),
        "client_acc_global": personal[-1].get("global_client_acc") if personal else None,
        "client_acc_personal": personal[-1]["personal_acc"] if personal else None,
        "personal_acc_by_round": [(x["round"], x["personal_acc"]) for x in personal],
        "accuracy_by_round": [(r["round"], r["accuracy"]) for r in evals],
        "accuracy_by_comm": curve_comm,
        "loss_by_round": [(r["round"], r["eval_loss"]) for r in rows if r.get("eval_loss") is not None],
    }


def _settings(run: RunFolder, config: dict) -> dict:
    """Every setting of the run as this version reads its config.yaml (defaults filled in), so runs of one
    variant group together even when a later version wrote keys an earlier one did not; the raw file when
    this version cannot read it."""
    from fedllm.config import flat_config

    try:
        return flat_config(run.config())
    except Exception:  # an older or foreign config: group by what the file says
        return {"raw": config}


def _variant_key(settings: dict) -> str:
    """The settings without what differs between seeds of one variant."""
    c = {k: v for k, v in settings.items() if k not in ("federation.seed", "output.dir")}
    if "raw" in c:
        raw = json.loads(json.dumps(c["raw"]))
        raw.get("federation", {}).pop("seed", None)
        raw.get("output", {}).pop("dir", None)
        c = {"raw": raw}
    return json.dumps(c, sort_keys=True, default=str)


def group_runs(runs: list[dict]) -> list[dict]:
    """Runs grouped by config except the seed, in first-seen order; each group named and summarized."""
    groups: dict[str, list[dict]] = {}
    for r in runs:
        groups.setdefault(_variant_key(r["settings"]), []).append(r)
    out = []
    for members in groups.values():
        parents = {Path(m["dir"]).resolve().parent.name for m in members}
        name = parents.pop() if len(members) > 1 and len(parents) == 1 else members[0]["name"]
        out.append(
            {
                "name": name,
                "strategy": members[0]["strategy"],
                "benchmark": members[0]["benchmark"],
                "runs": [m["dir"] for m in members],
                "seeds": [m["seed"] for m in members],
                **{
                    k: _stats([m[k] for m in members])
                    for k in (
                        "final_accuracy",
                        "best_accuracy",
                        "final_loss",
                        "up_bytes",
                        "down_bytes",
                        "wall_s",
                        "client_acc_global",
                        "client_acc_personal",
                    )
                },
                "rounds": members[0]["rounds"],
                "local_steps": members[0]["local_steps"],
                **{
                    k: _curve([m[k] for m in members])
                    for k in (
                        "accuracy_by_round",
                        "accuracy_by_comm",
                        "loss_by_round",
                        "personal_acc_by_round",
                    )
                },
            }
        )
    names = [g["name"] for g in out]
    for g, members in zip(out, groups.values(), strict=True):
        if names.count(g["name"]) > 1:  # e.g. seed-0 of several variants: name them by their folder too
            g["name"] = f"{Path(members[0]['dir']).resolve().parent.name}/{g['name']}"
    return out


def _stats(values: list) -> dict | None:
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    return {
        "mean": statistics.fmean(vals),
        "std": statistics.stdev(vals) if len(vals) > 1 else 0.0,
        "n": len(vals),
    }


def _curve(curves: list[list]) -> list[tuple[float, float, float]]:
    """Point-wise (x, mean, std) over the runs' curves, on the points they all have (x: mean of their x)."""
    n = min((len(c) for c in curves), default=0)
    out = []
    for i in range(n):
        xs, ys = [c[i][0] for c in curves], [c[i][1] for c in curves]
        out.append((statistics.fmean(xs), statistics.fmean(ys), statistics.stdev(ys) if len(ys) > 1 else 0.0))
    return out


def _fmt(s: dict | None, spec: str, scale: float = 1.0) -> str:
    if s is None:
        return "n/a"
    text = format(s["mean"] * scale, spec)
    return text + (f"±{format(s['std'] * scale, spec)}" if s["n"] > 1 else "")


def table(groups: list[dict]) -> str:
    head = (
        f"{'run (seeds)':<26} {'strategy':<9} {'rounds x steps':>14} {'benchmark':<10} {'final acc':>15} "
        f"{'best acc':>15} {'loss':>15} {'clients global':>15} {'clients own':>15} {'up MB':>9} "
        f"{'down MB':>9} {'wall s':>8}"
    )
    lines = [head, "-" * len(head)]
    for g in groups:
        label = g["name"] + (f" ({len(g['runs'])})" if len(g["runs"]) > 1 else "")
        schedule = f"{g['rounds']} x {g['local_steps']}"
        lines.append(
            f"{label[:26]:<26} {g['strategy']:<9} {schedule:>14} "
            f"{str(g['benchmark'])[:10]:<10} "
            f"{_fmt(g['final_accuracy'], '.4f'):>15} {_fmt(g['best_accuracy'], '.4f'):>15} "
            f"{_fmt(g['final_loss'], '.4f'):>15} {_fmt(g['client_acc_global'], '.4f'):>15} "
            f"{_fmt(g['client_acc_personal'], '.4f'):>15} "
            f"{_fmt(g['up_bytes'], '.2f', 1e-6):>9} {_fmt(g['down_bytes'], '.2f', 1e-6):>9} "
            f"{_fmt(g['wall_s'], '.1f'):>8}"
        )
    if any(len(g["runs"]) > 1 for g in groups):
        lines.append("(mean±std over the seeds of each group)")
    return "\n".join(lines)


PLOTS = (
    ("accuracy_by_round", "round", "benchmark accuracy", "accuracy_vs_round.png"),
    (
        "accuracy_by_comm",
        "cumulative communication (bytes, up + down)",
        "benchmark accuracy",
        "accuracy_vs_communication.png",
    ),
    ("loss_by_round", "round", "held-out loss", "loss_vs_round.png"),
    (
        "personal_acc_by_round",
        "round",
        "clients' own accuracy (personalized)",
        "personal_accuracy_vs_round.png",
    ),
)


CHANCE = 0.25  # four options: the benchmarks' chance level


def _byte_unit(largest: float) -> tuple[float, str]:
    for scale, unit in ((1e9, "GB"), (1e6, "MB"), (1e3, "KB")):
        if largest >= scale:
            return scale, unit
    return 1.0, "bytes"


def _budget(g: dict) -> str:
    return f"{g['rounds']} rounds x {g['local_steps'] or 'epochs of'} local steps"


def plot(groups: list[dict], out_dir: Path) -> list[Path]:
    """One figure per curve (PNG and PDF): integer rounds, bytes in KB/MB/GB, the base model's accuracy and
    chance as reference lines, and runs of different budgets (rounds x local steps) said in the legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    paths = []
    mixed = len({_budget(g) for g in groups}) > 1
    for key, xlabel, ylabel, fname in PLOTS:
        if not any(g[key] for g in groups):
            continue  # e.g. no benchmark in any run: no accuracy plots
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        scale, unit = (1.0, "")
        if key == "accuracy_by_comm":
            scale, unit = _byte_unit(max(x for g in groups for x, _, _ in g[key]))
        for g in groups:
            if not g[key]:
                continue
            xs, ys, sd = zip(*g[key], strict=True)
            xs = [x / scale for x in xs]
            n = len(g["runs"])
            label = g["name"] if g["name"] == g["strategy"] else f"{g['name']} ({g['strategy']})"
            label += f", {n} seeds" if n > 1 else ""
            label += f", {_budget(g)}" if mixed else ""
            (line,) = ax.plot(xs, ys, marker="o", markersize=3, label=label)
            if n > 1:
                ax.fill_between(
                    xs,
                    [y - s for y, s in zip(ys, sd, strict=True)],
                    [y + s for y, s in zip(ys, sd, strict=True)],
                    color=line.get_color(),
                    alpha=0.2,
                )
        if key in ("accuracy_by_round", "accuracy_by_comm"):
            starts = [g["accuracy_by_round"][0][1] for g in groups if g["accuracy_by_round"]]
            starts_at_zero = [g["accuracy_by_round"][0][0] == 0 for g in groups if g["accuracy_by_round"]]
            if starts and all(starts_at_zero):
                ax.axhline(
                    sum(starts) / len(starts), color="0.4", ls="--", lw=1, label="base model (round 0)"
                )
            ax.axhline(CHANCE, color="0.6", ls=":", lw=1, label="chance (4 options)")
        if xlabel == "round":
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel(xlabel.replace("(bytes, up + down)", f"({unit}, up + down)") if unit else xlabel)
        ax.set_ylabel(
            ylabel + (" (mean ± std over seeds)" if any(len(g["runs"]) > 1 for g in groups) else "")
        )
        ax.set_title(
            f"{ylabel} against {xlabel.split(' (')[0]}" + (" (runs of different budgets)" if mixed else ""),
            fontsize=10,
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / fname
        fig.savefig(path, dpi=150)
        fig.savefig(path.with_suffix(".pdf"))
        plt.close(fig)
        paths.append(path)
    return paths


def report(run_dirs: list[Path], out_dir: Path | None = None) -> str:
    """Table text; writes the plots and report.json into ``out_dir`` (default: ``reports/report-<time>``,
    never into a run's own folder)."""
    import time

    runs = [load_run(d) for d in run_dirs]
    groups = group_runs(runs)
    out = Path(out_dir or Path("reports") / f"report-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    paths = plot(groups, out)
    for r in runs:
        r.pop("config")
    atomic_write_text(
        out / "report.json",
        json.dumps({"groups": groups, "runs": runs, "plots": [str(p) for p in paths]}, indent=1),
    )
    return table(groups) + f"\n\nreport folder {out}; plots: " + ", ".join(str(p) for p in paths)
