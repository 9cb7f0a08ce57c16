"""What every reproduction shares: its command-line options, the federation loop over fedllm's own server
and client algorithms, results written atomically, plots, the closing JSON line.

A reproduction drives the same :class:`~fedllm.server.Server`, strategies and
:class:`~fedllm.client.base.ClientAlgorithm` classes as an LLM run, on a small torch model whose loss gives
its paper's update (:class:`~fedllm.client.module_runtime.ModuleRuntime`); only the model and the data are
its own.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from fedllm.client.module_runtime import ModuleClient, ModuleRuntime
from fedllm.round_loop import one_round
from fedllm.server import RoundPlan, Server


def add_common_arguments(p: argparse.ArgumentParser, default_output: str) -> None:
    p.add_argument("--seeds", type=int, default=3, help="how many seeds (default 3)")
    p.add_argument("--first-seed", type=int, default=0, help="the first seed (default 0)")
    p.add_argument("--output", default=default_output, help=f"results folder (default {default_output})")
    p.add_argument("--quick", action="store_true", help="a seconds-long size (for tests)")


def seeds_of(args: argparse.Namespace) -> list[int]:
    if args.seeds < 1:
        raise ValueError("--seeds must be >= 1")
    return list(range(args.first_seed, args.first_seed + args.seeds))


def federate(
    server: Server,
    runtime: ModuleRuntime,
    clients: dict[int, ModuleClient],
    rounds: int,
    after_round: Callable[[int], None] | None = None,
    progress: str | None = None,
) -> list[dict]:
    """``rounds`` rounds of the round every driver runs (:func:`fedllm.round_loop.one_round`: the server's
    plan, each sampled client's local work on ``runtime``, the server's acceptance and aggregation);
    ``after_round(r)`` sees the server after each. Returns the rows."""

    def train(plan: RoundPlan) -> dict[int, Any]:
        return {k: runtime.train(clients[k], plan.starts[k]) for k in plan.active}

    rows = []
    bar = tqdm(range(1, rounds + 1), desc=progress, leave=False, disable=None if progress else True)
    for r in bar:
        done = one_round(server, r, train)  # the round every driver runs (fedllm/round_loop.py)
        if done.row["n_failed"]:
            raise RuntimeError(f"round {r}: the server left clients out: {done.row['failed']}")
        rows.append(done.row)
        if after_round is not None:
            after_round(r)
    return rows


def mean_std(values: Sequence[float]) -> dict[str, float]:
    vals = [float(v) for v in values]
    return {
        "mean": statistics.fmean(vals),
        "std": statistics.stdev(vals) if len(vals) > 1 else 0.0,
        "n": len(vals),
    }


def loglog_slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """The least-squares slope of log(y) against log(x)."""
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = statistics.fmean(lx), statistics.fmean(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly, strict=True)) / sum((a - mx) ** 2 for a in lx)


def write_results(out: Path, name: str, results: dict[str, Any]) -> Path:
    from fedllm.files import atomic_write_text

    out.mkdir(parents=True, exist_ok=True)
    results = {"reproduction": name, "date": time.strftime("%Y-%m-%d"), **results}
    path = out / "results.json"
    atomic_write_text(path, json.dumps(results, indent=1, allow_nan=False))
    return path


def figure(ncols: int = 1, width: float = 6.0, height: float = 4.2):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(width * ncols, height), squeeze=False)
    return plt, fig, list(axes[0])


def save_figure(plt, fig, out: Path, stem: str) -> list[str]:
    fig.tight_layout()
    paths = []
    for ext in ("png", "pdf"):
        path = out / f"{stem}.{ext}"
        fig.savefig(path, dpi=150)
        paths.append(str(path))
    plt.close(fig)
    return paths


def finish(summary: dict[str, Any], table: str) -> int:
    """The table on stdout, then one JSON line (the last line)."""
    print(table)
    print(json.dumps(summary, allow_nan=False))
    sys.stdout.flush()
    return 0
