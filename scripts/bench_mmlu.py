"""MMLU scoring speed: prefix reuse vs one forward per question vs one forward per choice, same questions.

A 24M-parameter Llama (hidden 512, 8 layers, GQA 8/4) with a byte-level BPE tokenizer that adds BOS (both
built here, random weights: speed and exactness do not need trained ones) scores the built-in benchmark's
questions in MMLU's prompt format, k-shot from its dev split, three ways in one run:

* ``reuse``:  fedllm's default, each subject's header + shots computed once (eval/scoring.py);
* ``single``: one forward per question (what lm-evaluation-harness does for MMLU);
* ``naive``:  one forward per choice (four per question), batch 1.

Predictions must agree on every question and log-likelihoods within 1e-4 (checked, and reported). Each
configuration runs 0-shot and k-shot. ``--export DIR`` also writes the model, tokenizer and questions for
an lm-evaluation-harness run on the same data (see README). Last line: one JSON object.

    python scripts/bench_mmlu.py [--shots 5] [--per-subject 60] [--subjects 4] [--batch-size 16] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def build_tokenizer(texts: list[str]):
    """A byte-level BPE trained on the benchmark text, with BOS (as Llama-3's tokenizer adds)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=2000,
            special_tokens=["<s>", "</s>", "<pad>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", model_max_length=2048
    )


def build_model(tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg).eval()


def naive(model, tokenizer, questions, dev, k) -> list[list[float]]:
    """One forward per choice, batch 1, full continuation scoring."""
    from eval.mmlu import build_context, continuation_ids

    out = []
    with torch.no_grad():
        for q in questions:
            ctx = build_context(q, dev.get(q.subject, [])[:k])
            scores = []
            for letter in "ABCD":
                c, cont = continuation_ids(tokenizer, ctx, f" {letter}")
                logp = torch.log_softmax(model(torch.tensor([c + cont])).logits[0].float(), -1)
                scores.append(sum(logp[len(c) - 1 + i, t].item() for i, t in enumerate(cont)))
            out.append(scores)
    return out


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def compare(name, scores, ref) -> dict:
    preds = [max(range(4), key=lambda c: s[c]) for s in scores]
    ref_preds = [max(range(4), key=lambda c: s[c]) for s in ref]
    return {
        f"{name}_agreement": sum(a == b for a, b in zip(preds, ref_preds, strict=True)) / len(ref),
        f"{name}_max_abs_dll": max(
            abs(a - b) for s, r in zip(scores, ref, strict=True) for a, b in zip(s, r, strict=True)
        ),
    }


def bench(model, tokenizer, questions, dev, k, batch_size, with_naive) -> dict:
    from eval.mmlu import score_questions

    def run(reuse):
        return [
            r.loglikelihoods
            for r in score_questions(model, tokenizer, questions, dev, k, batch_size, reuse=reuse)
        ]

    run(True)  # warm-up (allocator, kernels)
    single, t_single = timed(lambda: run(False))
    reuse, t_reuse = timed(lambda: run(True))
    n = len(questions)
    out = {
        "shots": k,
        "questions": n,
        "reuse_qps": n / t_reuse,
        "single_qps": n / t_single,
        "reuse_over_single": t_single / t_reuse,
        **compare("reuse_vs_single", reuse, single),
    }
    if with_naive:
        slow, t_naive = timed(lambda: naive(model, tokenizer, questions, dev, k))
        out.update(
            {
                "naive_qps": n / t_naive,
                "reuse_over_naive": t_naive / t_reuse,
                **compare("reuse_vs_naive", reuse, slow),
            }
        )
    return out


def export_for_harness(folder: Path, model, tokenizer, questions, dev) -> None:
    """The model, tokenizer and an MMLU-format json task (test + dev) for lm-evaluation-harness."""
    model.save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")
    for split, qs in (("test", questions), ("dev", [q for s in dev.values() for q in s])):
        with open(folder / f"{split}.jsonl", "w") as fh:
            for q in qs:
                fh.write(
                    json.dumps(
                        {
                            "question": q.question,
                            "subject": q.subject,
                            "choices": list(q.choices),
                            "answer": q.answer,
                        }
                    )
                    + "\n"
                )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shots", type=int, default=5)
    p.add_argument("--per-subject", type=int, default=60, help="questions per subject")
    p.add_argument("--subjects", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-naive", action="store_true", help="skip the slow one-forward-per-choice baseline")
    p.add_argument(
        "--export", help="also write model, tokenizer and questions here for lm-evaluation-harness"
    )
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from eval.mmlu import build_context
    from eval.mmlu_data import load_questions

    subjects = sorted({q.subject for q in load_questions("builtin")})[: args.subjects]
    questions = load_questions("builtin", subjects=subjects, limit=args.per_subject)
    dev = {}
    for q in load_questions("builtin", "dev", subjects):
        dev.setdefault(q.subject, []).append(q)
    tokenizer = build_tokenizer([build_context(q, dev[q.subject][: args.shots]) for q in questions])
    model = build_model(tokenizer)
    if args.export:
        export_for_harness(
            Path(args.export), model, tokenizer, questions, {s: v[: args.shots] for s, v in dev.items()}
        )
    results = {
        "params_M": sum(p.numel() for p in model.parameters()) / 1e6,
        "threads": args.threads,
        "batch_size": args.batch_size,
    }
    for k in sorted({0, args.shots}):
        r = bench(model, tokenizer, questions, dev, k, args.batch_size, not args.no_naive)
        results[f"{k}_shot"] = r
        print(
            f"{k}-shot: reuse {r['reuse_qps']:.1f} q/s, single {r['single_qps']:.1f} q/s "
            f"({r['reuse_over_single']:.2f}x)"
            + (f", naive {r['naive_qps']:.1f} q/s ({r['reuse_over_naive']:.1f}x)" if "naive_qps" in r else "")
            + f"; agreement {r['reuse_vs_single_agreement']:.3f}, max |dLL| "
            f"{r['reuse_vs_single_max_abs_dll']:.1e}",
            flush=True,
        )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
