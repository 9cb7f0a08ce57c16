"""MMLU scoring speed: batched single-forward scoring vs naive one forward per choice.

Both score the same questions with the same model in the same run (the
built-in benchmark on the built-in base, and on a larger random Llama where
the forward pass dominates); the predictions must agree. Last line: one JSON
object with questions per second and the speed-up.

    python scripts/bench_mmlu.py [--limit 20] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def naive(model, tokenizer, questions) -> list[int]:
    """One forward per choice, batch 1, full continuation scoring."""
    from eval.mmlu import build_context, continuation_ids

    preds = []
    with torch.no_grad():
        for q in questions:
            ctx = build_context(q, [])
            scores = []
            for letter in "ABCD":
                c, k = continuation_ids(tokenizer, ctx, f" {letter}")
                logp = torch.log_softmax(model(torch.tensor([c + k])).logits[0].float(), -1)
                scores.append(sum(logp[len(c) - 1 + i, t].item() for i, t in enumerate(k)))
            preds.append(max(range(4), key=lambda i: scores[i]))
    return preds


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def bench(model, tokenizer, questions, batch_size: int) -> dict:
    from eval.mmlu import score_questions

    fast, t_fast = timed(lambda: score_questions(model, tokenizer, questions, batch_size=batch_size))
    slow, t_slow = timed(lambda: naive(model, tokenizer, questions))
    agree = sum(r.predicted == p for r, p in zip(fast, slow, strict=True)) / len(questions)
    return {"questions": len(questions), "fast_qps": len(questions) / t_fast, "naive_qps": len(questions) / t_slow,
            "speedup": t_slow / t_fast, "prediction_agreement": agree}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--limit", type=int, default=20, help="questions per subject")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from eval.data import load_questions
    from fedllm.builtin_model import ensure_builtin_base

    path = ensure_builtin_base()
    tok = AutoTokenizer.from_pretrained(path)
    questions = load_questions("builtin", limit=args.limit)
    results = {}
    tiny = AutoModelForCausalLM.from_pretrained(path).eval()
    results["builtin_200k"] = bench(tiny, tok, questions, args.batch_size)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=256, intermediate_size=688, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=128,
                      pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    results["random_llama_7M"] = bench(LlamaForCausalLM(cfg).eval(), tok, questions, args.batch_size)
    for name, r in results.items():
        print(f"{name:16s} fast {r['fast_qps']:8.1f} q/s  naive {r['naive_qps']:7.1f} q/s  "
              f"speed-up {r['speedup']:5.1f}x  agreement {r['prediction_agreement']:.3f}")
    print(json.dumps({"threads": args.threads, "batch_size": args.batch_size, **results}))


if __name__ == "__main__":
    main()
