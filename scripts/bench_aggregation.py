"""Server cost of each strategy on TinyLlama-shaped adapters, against a dense-SVD reference.

10 clients with ranks [64,32,16,16,8,8,4,4,4,4] adapt q, k, v, o, gate, up
and down of 22 layers (hidden 2048, intermediate 5632, k/v to 256), float32,
torch pinned to one thread. Each strategy runs in its own process so its peak
memory is its own. The dense reference (form sum_k p_k s_k B_k A_k, full SVD,
truncate) is timed on one layer and scaled by 22, and its results are compared
with ours on that layer. Last line: one JSON object.

    python scripts/bench_aggregation.py [--layers 22] [--dense-layers 1]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch

RANKS = [64, 32, 16, 16, 8, 8, 4, 4, 4, 4]
HIDDEN, INTER, KV = 2048, 5632, 256
SHAPES = {  # out, in
    "self_attn.q_proj": (HIDDEN, HIDDEN),
    "self_attn.k_proj": (KV, HIDDEN),
    "self_attn.v_proj": (KV, HIDDEN),
    "self_attn.o_proj": (HIDDEN, HIDDEN),
    "mlp.gate_proj": (INTER, HIDDEN),
    "mlp.up_proj": (INTER, HIDDEN),
    "mlp.down_proj": (HIDDEN, INTER),
}


def make_updates(layers: int, seed: int = 0):
    from fedllm.aggregation import ClientUpdate
    from fedllm.factors import LoraFactors

    gen = torch.Generator().manual_seed(seed)
    counts = [50 + 37 * k for k in range(len(RANKS))]
    updates = []
    for k, r in enumerate(RANKS):
        factors = {}
        for layer in range(layers):
            for name, (out_dim, in_dim) in SHAPES.items():
                A = torch.randn(r, in_dim, generator=gen) / in_dim**0.5
                B = torch.randn(out_dim, r, generator=gen) / r**0.5
                factors[f"model.layers.{layer}.{name}"] = LoraFactors(A, B, 2.0 * r / r)
        updates.append(ClientUpdate(k, counts[k], factors))
    return updates


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_one(name: str, layers: int) -> dict:
    from fedllm.aggregation import STRATEGIES, ClientUpdate, GlobalState

    updates = make_updates(layers)
    state = GlobalState()
    if name == "fedsb":  # clients send an r x r matrix between bases the first round made (its dense steps)
        state = fedsb_state(updates)
        updates = [
            ClientUpdate(u.client_id, u.num_examples, u.factors, extras=dict(state.extras)) for u in updates
        ]
    before = peak_mb()
    strategy = STRATEGIES[name]()
    t0 = time.perf_counter()
    res = strategy.aggregate(updates, state)
    for k, r in enumerate(RANKS):  # what each client downloads
        strategy.client_factors(res.state, r, 2.0, k)
        strategy.client_extras(res.state, k)
    return {"strategy": name, "seconds": time.perf_counter() - t0, "peak_extra_mb": peak_mb() - before}


def fedsb_state(updates):
    """Fed-SB's state after its initialization round: bases at the largest rank and an R per module."""
    from fedllm.aggregation import GlobalState
    from fedllm.aggregation.fedsb import CORE, RANK
    from fedllm.factors import LoraFactors

    r = max(RANKS)
    factors, extras = {}, {RANK: r}
    for key, f in updates[0].factors.items():
        out_f, in_f = f.B.shape[0], f.A.shape[1]
        qb, _ = torch.linalg.qr(torch.randn(out_f, r))
        qa, _ = torch.linalg.qr(torch.randn(in_f, r))
        factors[key] = LoraFactors(qa.T.contiguous(), qb, 1.0)
        extras[f"{CORE}{key}"] = torch.randn(r, r)
    return GlobalState(factors, extras=extras)


def dense_reference(dense_layers: int) -> dict:
    """Dense FlexLoRA on ``dense_layers`` layers; compares our factors with it."""
    from fedllm.aggregation import GlobalState, example_weights
    from fedllm.aggregation.flexlora import FlexLoRA
    from fedllm.aggregation.florist import FLoRIST

    updates = make_updates(dense_layers)
    w = example_weights(updates)
    t0 = time.perf_counter()
    dense_svd = {}
    for key in updates[0].factors:
        W = sum(p * u.factors[key].delta() for p, u in zip(w, updates, strict=True))
        U, S, Vh = torch.linalg.svd(W, full_matrices=False)
        dense_svd[key] = (W, U, S, Vh)
        for r in sorted(set(RANKS)):
            _ = (U[:, :r] * S[:r]) @ Vh[:r]
    dense_s = time.perf_counter() - t0
    ours = FlexLoRA().aggregate(updates, GlobalState()).state
    florist = FLoRIST(tau=1.0).aggregate(updates, GlobalState()).merged
    full_err, trunc_err, checked, skipped = 0.0, 0.0, 0, 0
    for key, (W, U, S, Vh) in dense_svd.items():
        nW = torch.linalg.norm(W)
        full_err = max(full_err, float(torch.linalg.norm(ours.factors[key].delta() - W) / nW))
        full_err = max(full_err, float(torch.linalg.norm(florist[key].delta() - W) / nW))
        for r in sorted(set(RANKS)):
            if (S[r - 1] - S[r]) / S[r - 1] < 0.01:
                skipped += 1
                continue
            f = FlexLoRA().client_factors(ours, r, 2.0, 0)[key]
            ref = (U[:, :r] * S[:r]) @ Vh[:r]
            trunc_err = max(trunc_err, float(torch.linalg.norm(f.delta() - ref) / torch.linalg.norm(ref)))
            checked += 1
    return {
        "dense_seconds_measured": dense_s,
        "max_rel_err_full": full_err,
        "max_rel_err_truncated": trunc_err,
        "truncations_checked": checked,
        "truncations_skipped_near_ties": skipped,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=22)
    p.add_argument("--dense-layers", type=int, default=1)
    p.add_argument("--only", help=argparse.SUPPRESS)
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.only:
        print(json.dumps(run_one(args.only, args.layers)))
        return
    from fedllm.aggregation import STRATEGIES

    rows = {}
    for name in sorted(n for n in STRATEGIES if n != "floral"):
        out = subprocess.run(
            [sys.executable, __file__, "--only", name, "--layers", str(args.layers)],
            capture_output=True,
            text=True,
            check=True,
        )
        rows[name] = json.loads(out.stdout.strip().splitlines()[-1])
        print(
            f"{name:9s} {rows[name]['seconds']:8.2f} s  peak +{rows[name]['peak_extra_mb']:8.1f} MB",
            flush=True,
        )
    ref = dense_reference(args.dense_layers)
    dense_total = ref["dense_seconds_measured"] * args.layers / args.dense_layers
    print(
        f"dense FlexLoRA reference: {ref['dense_seconds_measured']:.2f} s on {args.dense_layers} layer(s), "
        f"scaled x{args.layers / args.dense_layers:.0f} -> {dense_total:.1f} s"
    )
    result = {
        "layers": args.layers,
        "ranks": RANKS,
        "threads": 1,
        "strategies": rows,
        "dense_reference_seconds_scaled": dense_total,
        "dense_reference_note": f"timed on {args.dense_layers} layer(s) and scaled to {args.layers}",
        "speedup_flexlora_vs_dense": dense_total / rows["flexlora"]["seconds"],
        "speedup_florist_vs_dense": dense_total / rows["florist"]["seconds"],
        **{k: v for k, v in ref.items() if k != "dense_seconds_measured"},
    }
    print(
        f"FlexLoRA {result['speedup_flexlora_vs_dense']:.0f}x, FLoRIST "
        f"{result['speedup_florist_vs_dense']:.0f}x "
        f"faster than dense; max rel err full {ref['max_rel_err_full']:.2e}, "
        f"truncated {ref['max_rel_err_truncated']:.2e}"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
