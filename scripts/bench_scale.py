"""The research setting's sizes: what grows with the number of clients and with the number of rounds.

Runs fedllm's own simulation on the built-in base (one process per point, so
peak memory is the point's own) and reports, per point: peak RSS, the newest
checkpoint's size, the run folder's size, and the per-round time split into
planning, client training, aggregation (server) and merging, plus the
checkpoint write. Two sweeps:

- clients: 16, 256, 1,024 clients in total, 8 sampled per round, 10 rounds,
  for FedIT, FLoRA, FLoRIST and SCAFFOLD (FedIT with SCAFFOLD's control
  variates). Target: peak RSS within 10% and per-round time within 20% from
  16 to 1,024 clients (state is on disk, evaluation visits the round's
  clients only).
- rounds: 10, 50, 200 rounds with 16 clients, 8 sampled, for FLoRA and
  FLoRIST, whose merged residual is kept in its smallest exact form. Target:
  peak RSS and checkpoint size within 25% from 10 to 200 rounds.

Every point uses the same data (the built-in set at 1,200 examples per skill:
every configuration splits the same examples) and ``client.local_steps=2``
(the sweep measures the federation's overhead, not learning). Numbers are
from this machine and run; the ratios are what carries to other machines.

    python scripts/bench_scale.py [--clients 16,256,1024] [--rounds 10,50,200] [--quick]

Last line: one JSON object with every point and the growth ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

STRATEGIES = {"fedit": [], "flora": [], "florist": [], "scaffold": ["client.algorithm=scaffold"]}


def folder_mb(path: Path) -> float:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file()) / 2**20


def point(strategy: str, clients: int, rounds: int, run_dir: Path) -> dict:
    """One run in this process; its measurements."""
    from fedllm.config import load_config
    from fedllm.run.checkpoint import latest_checkpoint
    from fedllm.simulation import Simulation

    name = "fedit" if strategy == "scaffold" else strategy
    cfg = load_config(
        None,
        [
            f"aggregation.name={name}",
            *STRATEGIES[strategy],
            f"federation.num_clients={clients}",
            "federation.clients_per_round=8",
            f"federation.rounds={rounds}",
            "data.builtin_examples_per_skill=1200",
            "data.min_examples_per_client=4",
            "client.local_steps=2",
            "client.batch_size=4",
            "eval.benchmark=none",
            "eval.limit=1",
            f"eval.every={rounds}",
            f"output.dir={run_dir}",
        ],
    )
    t0 = time.perf_counter()
    sim = Simulation(cfg, run_dir)
    checkpoint_s: list[float] = []
    sim.on_phase.append(lambda phase, s: checkpoint_s.append(s) if phase == "checkpoint" else None)
    sim.setup()
    setup_s = time.perf_counter() - t0
    sim.run()
    rows = [
        r for r in (json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()) if r["round"]
    ]
    later = rows[len(rows) // 2 :]  # the second half: the residual has reached its bound

    def median(key):
        return statistics.median(r.get(key, 0.0) for r in later)

    phases = {
        "plan_s": median("time_plan_s"),
        "train_s": median("time_train_s"),
        "server_s": median("time_server_s"),
        "merge_s": median("time_merge_s"),
        "checkpoint_s": statistics.median(checkpoint_s[len(checkpoint_s) // 2 :]),
    }
    ckpt = latest_checkpoint(run_dir)
    return {
        "strategy": strategy,
        "clients": clients,
        "rounds": rounds,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "checkpoint_mb": folder_mb(ckpt) if ckpt else 0.0,
        "run_folder_mb": folder_mb(run_dir),
        "setup_s": setup_s,
        "round_s": sum(phases.values()),
        **phases,
        "down_params_last": rows[-1]["down_params"],
    }


def run_point(strategy: str, clients: int, rounds: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run(
            [sys.executable, __file__, "--point", f"{strategy},{clients},{rounds}", "--dir", tmp],
            capture_output=True,
            text=True,
            env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"},
        )
    if out.returncode:
        raise SystemExit(f"{strategy} {clients} clients {rounds} rounds failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", default="16,256,1024")
    ap.add_argument("--rounds", default="10,50,200")
    ap.add_argument("--strategies", default="fedit,flora,florist,scaffold")
    ap.add_argument("--quick", action="store_true", help="16/64 clients, 4/12 rounds (a smoke run)")
    ap.add_argument("--point", help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.point:
        strategy, clients, rounds = args.point.split(",")
        print(json.dumps(point(strategy, int(clients), int(rounds), Path(args.dir) / "run")))
        return
    from fedllm.logs import setup_logging

    setup_logging("WARNING")
    sizes = [16, 64] if args.quick else [int(x) for x in args.clients.split(",")]
    lengths = [4, 12] if args.quick else [int(x) for x in args.rounds.split(",")]
    strategies = args.strategies.split(",")
    points, ratios = [], {}

    def sweep(s: str, grid: list[tuple[int, int]], what: str, measures: dict[str, str]) -> None:
        """Run ``grid`` (clients, rounds) for strategy ``s``; ratio last / first of each measure."""
        got = [run_point(s, n, r) for n, r in grid]
        points.extend(got)
        for p in got:
            print(
                f"{s:9s} {p['clients']:5d} clients {p['rounds']:4d} rounds: RSS {p['peak_rss_mb']:.0f} MB, "
                f"round {p['round_s']:.3f} s, checkpoint {p['checkpoint_mb']:.2f} MB, run folder "
                f"{p['run_folder_mb']:.1f} MB, down {p['down_params_last']}",
                flush=True,
            )
        for name, key in measures.items():
            ratios[f"{s}_{what}_{name}"] = got[-1][key] / got[0][key]

    for s in strategies:
        sweep(s, [(n, lengths[0]) for n in sizes], "clients", {"rss": "peak_rss_mb", "round_time": "round_s"})
    for s in [s for s in strategies if s in ("flora", "florist")]:
        sweep(
            s,
            [(sizes[0], r) for r in lengths],
            "rounds",
            {"rss": "peak_rss_mb", "checkpoint": "checkpoint_mb"},
        )
    print(json.dumps({"clients": sizes, "rounds": lengths, "ratios": ratios, "points": points}))


if __name__ == "__main__":
    main()
