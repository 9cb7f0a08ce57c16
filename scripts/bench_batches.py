"""Padding and step time of length-grouped batches against plain shuffled ones (``client.group_by_length``).

On the clients of a config (default: the built-in default), builds one epoch
of batches per client both ways with fedllm's own batcher, and reports the
fraction of batch positions that are padding; then times the same number of
training steps (forward, backward, AdamW) of the first client's rank-r LoRA
on the built-in base with each kind of batch, alternating, in one process.

    python scripts/bench_batches.py [--config configs/x.yaml] [--steps 40] [key=value ...]

Numbers are from this machine and run; the ratio is what carries. Last line:
one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def padding_fraction(lengths: list[int], batches: list[list[int]]) -> float:
    cells = sum(max(lengths[i] for i in b) * len(b) for b in batches)
    return 1 - sum(lengths[i] for b in batches for i in b) / cells


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=None)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()

    import torch
    from accelerate import Accelerator

    from data_prep.prompts import collate
    from fedllm import assembly
    from fedllm.client.base import epoch_batches, token_lengths
    from fedllm.config import load_config
    from fedllm.logs import setup_logging

    setup_logging("WARNING")
    cfg = load_config(args.config, ["eval.benchmark=none", *args.overrides])
    fed = assembly.assemble(cfg, Accelerator(cpu=True))
    bs = cfg.client.batch_size
    pad = {"plain": [], "grouped": []}
    for c in fed.clients:
        lengths = token_lengths(c.train)
        for name, grouped in (("plain", False), ("grouped", True)):
            pad[name].append(padding_fraction(lengths, epoch_batches(lengths, bs, random.Random(0), grouped)))

    client = fed.clients[0]
    rt = fed.runtime
    start = fed.server.client_start(1, client.client_id)
    params, _ = rt.switch_in(client, start)
    opt = torch.optim.AdamW(params.values(), lr=1e-4)
    lengths = token_lengths(client.train)
    rng = random.Random(1)
    streams = {name: [] for name in pad}
    while min(len(s) for s in streams.values()) < args.steps:
        for name, grouped in (("plain", False), ("grouped", True)):
            streams[name] += epoch_batches(lengths, bs, rng, grouped)
    times = {name: 0.0 for name in pad}
    widths = {name: [] for name in pad}
    rt.model.train()
    for i in range(args.steps):  # alternate, so drift in machine load hits both alike
        for name in pad:
            batch = collate([client.train[j] for j in streams[name][i]], rt.tokenizer.pad_token_id)
            widths[name].append(batch["input_ids"].shape[1])
            t = time.perf_counter()
            loss = rt.model(**batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            times[name] += time.perf_counter() - t
    result = {
        "config": args.config or "default",
        "clients": len(fed.clients),
        "padding_fraction": {k: sum(v) / len(v) for k, v in pad.items()},
        "mean_width": {k: sum(v) / len(v) for k, v in widths.items()},
        "step_ms": {k: 1000 * v / args.steps for k, v in times.items()},
        "step_time_ratio_grouped_vs_plain": times["grouped"] / times["plain"],
    }
    for k in pad:
        print(
            f"{k:8s} padding {result['padding_fraction'][k]:.1%}, mean width {result['mean_width'][k]:.0f}, "
            f"step {result['step_ms'][k]:.1f} ms"
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
