"""Rounds per minute with 1 and N processes on the built-in default.

On 2 CPU cores little gain is expected (the processes share the cores); on
GPUs this is the figure users care about. All runs use the same config and
seed; the script reports how far each run's global adapter is from the
one-process run's. ``--parallel data`` measures the data-parallel layout
(all processes train each client; pair it with ``--batch-size`` divisible by
the process counts). Last line: one JSON object.

    python scripts/bench_scaling.py [--rounds 3] [--local-steps 60] [--processes 1 2 4 8] [--parallel clients]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file


def run(
    processes: int, out: Path, rounds: int, steps: int, parallel: str, batch_size: int
) -> tuple[float, float]:
    overrides = [
        f"federation.rounds={rounds}",
        f"client.local_steps={steps}",
        "eval.every=1000",
        "eval.benchmark=none",
        "eval.personalized=false",
        f"federation.parallel={parallel}",
        f"client.batch_size={batch_size}",
        f"output.dir={out}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // processes))}
    if torch.cuda.is_available():
        env.pop("OMP_NUM_THREADS")
    if processes == 1:
        cmd = [sys.executable, "-m", "fedllm.cli", "--log-level", "WARNING", "run", *overrides]
    else:
        env["ACCELERATE_USE_CPU"] = (
            "1" if not torch.cuda.is_available() else env.get("ACCELERATE_USE_CPU", "0")
        )
        cmd = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--multi_gpu",
            "--num_processes",
            str(processes),
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            "-m",
            "fedllm.cli",
            "--log-level",
            "WARNING",
            "run",
            *overrides,
        ]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    total = time.perf_counter() - t0
    loop = json.loads((out / "summary.json").read_text())["wall_s"]
    return loop, total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--local-steps", type=int, default=60)
    p.add_argument(
        "--processes", type=int, nargs="+", default=[1, 2], help="process counts (1 is always run)"
    )
    p.add_argument("--parallel", choices=["clients", "data"], default="clients")
    p.add_argument("--batch-size", type=int, default=8)
    args = p.parse_args()
    from fedllm.model.builtin_base import ensure_builtin_base

    ensure_builtin_base()
    counts = sorted({1, *args.processes})
    with tempfile.TemporaryDirectory() as tmp:
        res = {}
        for n in counts:
            loop, total = run(
                n, Path(tmp) / f"p{n}", args.rounds, args.local_steps, args.parallel, args.batch_size
            )
            res[n] = {"round_loop_s": loop, "total_s": total, "rounds_per_min": 60 * args.rounds / loop}
            rpm = res[n]["rounds_per_min"]
            print(
                f"{n} process(es): {rpm:.2f} rounds/min (loop {loop:.1f} s, total {total:.1f} s)", flush=True
            )
        a = load_file(Path(tmp) / "p1" / "global_adapter" / "adapter_model.safetensors")
        for n in counts[1:]:
            b = load_file(Path(tmp) / f"p{n}" / "global_adapter" / "adapter_model.safetensors")
            res[n]["speedup"] = res[n]["rounds_per_min"] / res[1]["rounds_per_min"]
            res[n]["max_abs_diff_global_adapter"] = max(float((a[k] - b[k]).abs().max()) for k in a)
    out = {
        "rounds": args.rounds,
        "local_steps": args.local_steps,
        "parallel": args.parallel,
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "processes": {str(n): res[n] for n in counts},
    }
    if 2 in res:  # the figure earlier versions reported
        out["speedup"] = res[2]["speedup"]
        out["max_abs_diff_global_adapter"] = res[2]["max_abs_diff_global_adapter"]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
