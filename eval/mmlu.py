"""MMLU evaluation the standard way, fast.

Prompt (lm-evaluation-harness ``mmlu`` and the original hendrycks code)::

    The following are multiple choice questions (with answers) about {subject}.\\n\\n
    {shot question}\\nA. ..\\nB. ..\\nC. ..\\nD. ..\\nAnswer: {gold}\\n\\n   (k times, dev split)
    {question}\\nA. ..\\nB. ..\\nC. ..\\nD. ..\\nAnswer:

Each choice is the continuation " A" .. " D", scored by its log-likelihood
after the context (the tokenizer adds BOS when it does so by default); the
prediction is the argmax. When every letter is a single token, one forward
pass of the context scores all four at once; otherwise each continuation is
scored in full. Batches are sorted by length to waste little on padding.

Run as a job: ``fedllm eval ...`` or ``accelerate launch -m eval.mmlu ...``
(questions are split over processes and gathered on the main process).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from eval.data import LETTERS, Question, load_questions, subject_category_map
from eval.subjects import CATEGORIES, category_of

log = logging.getLogger(__name__)

HEADER = "The following are multiple choice questions (with answers) about {}.\n\n"


def format_subject(subject: str) -> str:
    return subject.replace("_", " ")


def format_question(q: Question, with_answer: bool) -> str:
    text = q.question.strip() + "".join(f"\n{letter}. {c}" for letter, c in zip(LETTERS, q.choices, strict=True))
    text += "\nAnswer:"
    return text + (f" {LETTERS[q.answer]}\n\n" if with_answer else "")


def build_context(q: Question, shots: list[Question], tokenizer=None, max_len: int | None = None) -> str:
    """Header + shots + question; shots are dropped from the end while the prompt is too long."""
    shots = list(shots)
    while True:
        text = HEADER.format(format_subject(q.subject)) + "".join(format_question(s, True) for s in shots)
        text += format_question(q, False)
        if not shots or tokenizer is None or max_len is None or len(tokenizer(text)["input_ids"]) + 1 <= max_len:
            return text
        shots.pop()


@dataclass
class Record:
    subject: str
    index: int
    gold: int
    predicted: int
    loglikelihoods: list[float]


def continuation_ids(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """Context and continuation ids as the harness splits them (whole minus context prefix)."""
    ctx = tokenizer(context)["input_ids"]
    whole = tokenizer(context + continuation)["input_ids"]
    if whole[: len(ctx)] == ctx and len(whole) > len(ctx):
        return ctx, whole[len(ctx):]
    return ctx, tokenizer(continuation, add_special_tokens=False)["input_ids"]


def _pad(seqs: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    return ids.to(device), mask.to(device)


@torch.no_grad()
def score_fast(model, items: list[tuple[list[int], list[int]]], pad_id: int, batch_size: int) -> list[list[float]]:
    """Log-likelihoods of four single-token continuations from one forward per context."""
    device = next(model.parameters()).device
    order = sorted(range(len(items)), key=lambda i: -len(items[i][0]))
    out: list[list[float]] = [[]] * len(items)
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        ids, mask = _pad([items[i][0] for i in idx], pad_id, device)
        logits = model(input_ids=ids, attention_mask=mask).logits.float()
        last = mask.sum(1) - 1
        logp = torch.log_softmax(logits[torch.arange(len(idx), device=device), last], dim=-1)
        for row, i in enumerate(idx):
            out[i] = [logp[row, tok].item() for tok in items[i][1]]
    return out


@torch.no_grad()
def score_full(model, contexts: list[list[int]], continuations: list[list[int]], pad_id: int,
               batch_size: int) -> list[float]:
    """Sum of log-probabilities of each continuation after its context (any length)."""
    device = next(model.parameters()).device
    seqs = [c + k for c, k in zip(contexts, continuations, strict=True)]
    order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i]))
    out = [0.0] * len(seqs)
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        ids, mask = _pad([seqs[i] for i in idx], pad_id, device)
        logp = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits.float(), dim=-1)
        for row, i in enumerate(idx):
            n_ctx, n_cont = len(contexts[i]), len(continuations[i])
            pos = torch.arange(n_ctx - 1, n_ctx - 1 + n_cont, device=device)
            target = torch.tensor(continuations[i], device=device)
            out[i] = logp[row, pos, target].sum().item()
    return out


def score_questions(model, tokenizer, questions: list[Question], shots: dict[str, list[Question]] | None = None,
                    k: int = 0, batch_size: int = 16) -> list[Record]:
    """Score every question; fast path when all four letters are single tokens."""
    max_len = getattr(model.config, "max_position_embeddings", None)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    fast, slow = [], []
    for qi, q in enumerate(questions):
        context = build_context(q, (shots or {}).get(q.subject, [])[:k], tokenizer, max_len)
        enc = [continuation_ids(tokenizer, context, f" {letter}") for letter in LETTERS]
        ctx = enc[0][0]
        conts = [c for _, c in enc]
        if all(len(c) == 1 for c in conts) and all(e[0] == ctx for e in enc):
            fast.append((qi, ctx, [c[0] for c in conts]))
        else:
            slow.append((qi, [e[0] for e in enc], conts))
    ll: dict[int, list[float]] = {}
    if fast:
        scores = score_fast(model, [(c, t) for _, c, t in fast], pad_id, batch_size)
        ll.update({qi: s for (qi, _, _), s in zip(fast, scores, strict=True)})
    if slow:
        ctxs = [c for _, cs, _ in slow for c in cs]
        conts = [k_ for _, _, ks in slow for k_ in ks]
        flat = score_full(model, ctxs, conts, pad_id, batch_size)
        ll.update({qi: flat[4 * j: 4 * j + 4] for j, (qi, _, _) in enumerate(slow)})
    records = []
    for qi, q in enumerate(questions):
        s = ll[qi]
        records.append(Record(q.subject, q.index, q.answer, max(range(4), key=lambda c: s[c]), s))
    return records


def aggregate(records: list[Record], categories: dict[str, str] | None = None) -> dict:
    """Micro accuracy (the headline), per category and per subject."""
    by_subject: dict[str, list[int]] = defaultdict(list)
    by_category: dict[str, list[int]] = defaultdict(list)
    for r in records:
        hit = int(r.predicted == r.gold)
        by_subject[r.subject].append(hit)
        by_category[category_of(r.subject, categories)].append(hit)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return {
        "accuracy": mean([int(r.predicted == r.gold) for r in records]) if records else float("nan"),
        "n": len(records),
        "categories": {c: mean(v) for c, v in sorted(by_category.items())},
        "subjects": {s: mean(v) for s, v in sorted(by_subject.items())},
    }


@dataclass
class Benchmark:
    """Questions to score, the dev-split shots per subject, and where they came from."""

    source: str
    questions: list[Question]
    dev: dict[str, list[Question]]
    shots: int = 0


def load_benchmark(source: str = "builtin", shots: int = 0, subjects: list[str] | None = None,
                   limit: int = 0) -> Benchmark:
    """Load (and check) the questions and their shots: bad data fails here, before any model is loaded."""
    questions = load_questions(source, "test", subjects, limit)
    dev: dict[str, list[Question]] = {}
    if shots:
        for q in load_questions(source, "dev", sorted({q.subject for q in questions})):
            dev.setdefault(q.subject, []).append(q)
    return Benchmark(source, questions, dev, shots)


def evaluate(model, tokenizer, bench: Benchmark | str = "builtin", shots: int = 0, subjects: list[str] | None = None,
             limit: int = 0, batch_size: int = 16, accelerator=None) -> tuple[dict, list[Record]]:
    """Score (split over processes when ``accelerator`` has several) and aggregate.

    ``bench`` is a loaded :class:`Benchmark`, or a source to load with
    ``shots``, ``subjects`` and ``limit``.
    """
    if isinstance(bench, str):
        bench = load_benchmark(bench, shots, subjects, limit)
    mine = bench.questions
    if accelerator is not None and accelerator.num_processes > 1:
        mine = bench.questions[accelerator.process_index:: accelerator.num_processes]
    records = score_questions(model, tokenizer, mine, bench.dev, bench.shots, batch_size)
    if accelerator is not None and accelerator.num_processes > 1:
        from accelerate.utils import gather_object

        records = list({(r.subject, r.index): r for r in gather_object(records)}.values())
    records.sort(key=lambda r: (r.subject, r.index))  # the same order with any number of processes
    return aggregate(records, subject_category_map(bench.source)), records


def format_table(result: dict) -> str:
    lines = [f"{'group':<40} {'acc':>7}", "-" * 48, f"{'MMLU (micro)':<40} {result['accuracy']:>7.4f}"]
    for c in CATEGORIES:
        if c in result["categories"]:
            lines.append(f"  {c:<38} {result['categories'][c]:>7.4f}")
    for s, a in result["subjects"].items():
        lines.append(f"    {s:<36} {a:>7.4f}")
    return "\n".join(lines)


def write_results(path: Path, result: dict, records: list[Record], meta: dict) -> None:
    from fedllm.checkpoint import atomic_write_text

    payload = {**meta, **result, "records": [asdict(r) for r in records]}
    atomic_write_text(path, json.dumps(payload, indent=1))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="base model: 'builtin' (the default), a Hub id, a local or merged folder; "
                   "with --run: the run's own base (another is refused)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--adapter", help="a peft adapter folder to apply on the base")
    src.add_argument("--run", help="a fedllm run directory: evaluates its latest global adapter")
    p.add_argument("--round", type=int, help="with --run: the round whose global adapter to use")
    p.add_argument("--client", type=int, help="with --run: a client's personalized adapter")
    p.add_argument("--data", default="builtin", help="'builtin', cais/mmlu, or a local MMLU copy")
    p.add_argument("--shots", type=int, default=0, help="few-shot examples from the dev split (5 is usual)")
    p.add_argument("--subjects", nargs="*", default=None, help="subject subset")
    p.add_argument("--limit", type=int, default=0, help="first N questions per subject (0: all)")
    p.add_argument("--batch-size", type=int, default=16, help="questions per forward pass")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "auto"])
    p.add_argument("--output", help="write results and per-question records to this JSON file")


def run(args: argparse.Namespace) -> dict:
    """The eval job behind ``fedllm eval`` and ``python -m eval.mmlu``."""
    from accelerate import Accelerator

    from fedllm.export import load_for_eval

    bench = load_benchmark(args.data, args.shots, args.subjects, args.limit)  # bad data fails before the model loads
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    model, tokenizer = load_for_eval(args.model, args.adapter, args.run, args.round, args.client, args.dtype,
                                     accelerator.device)
    result, records = evaluate(model, tokenizer, bench, batch_size=args.batch_size, accelerator=accelerator)
    if accelerator.is_main_process:
        print(format_table(result))
        if args.output:
            meta = {"model": args.model, "adapter": args.adapter, "run": args.run, "data": args.data,
                    "shots": args.shots, "processes": accelerator.num_processes}
            write_results(Path(args.output), result, records, meta)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="eval.mmlu", description="MMLU log-likelihood evaluation")
    add_arguments(parser)
    args = parser.parse_args(argv)
    from fedllm.cli import friendly_errors

    with friendly_errors():
        run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
