"""FlowerTune's leaderboard evaluations: generative, zero-shot, greedy, the answer read from the text.

Three protocols, as FlowerTune's evaluation code (adap/flower, ``benchmarks/flowertune-llm/evaluation/``)
defines them; fedllm's own code, checked against theirs (``scripts/check_flowertune_agreement.py``):

``flowertune-general-nlp``
    MMLU's test split as ``lukaemon/mmlu`` has it, the STEM, social-sciences and humanities categories
    (``--benchmarks`` picks; "other" exists but the leaderboard leaves it out), one accuracy each and
    their mean. Prompt: "Answer the following multiple choice question." + "Question: ...?" + the
    lettered options + "The answer is:", in a ``<|im_start|>question ... <|im_start|>answer`` wrapper.
``flowertune-medical``
    PubMedQA (yes / no / maybe), MedMCQA, MedQA (4 options), CareQA, with Meditron's instructions.
``flowertune-finance``
    FPB, FiQA and TFNS sentiment: "Instruction: ...\\nInput: ...\\nAnswer: ", the label the first of
    positive / negative found in what follows "Answer: " (else neutral).

Generation is greedy. FlowerTune's general and medical code gives each question as many new tokens as
the first gold answer of its batch of ``--reference-batch-size`` (16) questions has tokens; the finance
code generates up to a total length of 512 tokens in batches of 32, so a question's budget is 512 less
the longest prompt of its batch. fedllm gives every question the budget FlowerTune's batching gives it
and then batches as it likes: prompts sorted by length, left-padded, ``--batch-size`` at a time, which is
what makes it faster than FlowerTune's loop of one ``generate`` per question with the same answers
(``scripts/bench_flowertune_eval.py``). The extraction is FlowerTune's (``format_answer`` and
``change_target``), quirks included: an MCQ answer is the first letter of the cleaned text, so
"Answer: B" reads as "a".
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from eval import flowertune_data as data
from eval.flowertune_data import BenchmarkDataError, as_int, field

log = logging.getLogger(__name__)

PROTOCOLS = ("harness-mmlu", "flowertune-general-nlp", "flowertune-finance", "flowertune-medical")
BENCHMARKS = {
    "flowertune-general-nlp": ("stem", "social_sciences", "humanities"),
    "flowertune-medical": ("pubmedqa", "medmcqa", "medqa", "careqa"),
    "flowertune-finance": ("fpb", "fiqa", "tfns"),
}
CHOICES = {  # every benchmark a protocol can run (general NLP: "other" as well)
    "flowertune-general-nlp": ("stem", "social_sciences", "humanities", "other"),
    **{k: v for k, v in BENCHMARKS.items() if k != "flowertune-general-nlp"},
}
# the reference's batch sizes: they set the generation budgets (see the module docstring)
REFERENCE_BATCH = {"flowertune-general-nlp": 16, "flowertune-medical": 16, "flowertune-finance": 32}
FINANCE_MAX_LENGTH = 512

MMLU_INSTRUCTION = "Answer the following multiple choice question."
# Meditron's instructions, as FlowerTune's medical evaluation quotes them
MEDICAL_INSTRUCTIONS = {
    "pubmedqa": "As an expert doctor in clinical science and medical knowledge, can you tell me if the "
    "following statement is correct? Answer yes, no, or maybe.",
    "medqa": "You are a medical doctor taking the US Medical Licensing Examination. You need to demonstrate "
    "your understanding of basic and clinical science, medical knowledge, and mechanisms underlying health, "
    "disease, patient care, and modes of therapy. Show your ability to apply the knowledge essential for "
    "medical practice. For the following multiple-choice question, select one correct answer from A to E. "
    "Base your answer on the current and standard practices referenced in medical guidelines.",
    "medmcqa": "You are a medical doctor answering realworld medical entrance exam questions. Based on your "
    "understanding of basic and clinical science, medical knowledge, and mechanisms underlying health, "
    "disease, patient care, and modes of therapy, answer the following multiple-choice question. Select one "
    "correct answer from A to D. Base your answer on the current and standard practices referenced in "
    "medical guidelines.",
}
MEDICAL_INSTRUCTIONS["careqa"] = MEDICAL_INSTRUCTIONS["medmcqa"]
FPB_INSTRUCTION = (
    "What is the sentiment of this news? Please choose an answer from {negative/neutral/positive}."
)
TFNS_INSTRUCTION = (
    "What is the sentiment of this tweet? Please choose an answer from {negative/neutral/positive}."
)
VALID = ("a", "b", "c", "d", "e", "yes", "no")


@dataclass
class Item:
    """One question as the model gets it."""

    benchmark: str
    index: int
    prompt: str  # the whole text given to the model
    gold: str
    answer_type: str  # mcq | boolean | sentiment
    max_new_tokens: int = 0  # set by the reference's batching (budgets)


@dataclass
class Record:
    benchmark: str
    index: int
    prompt: str
    generation: str
    extracted: str | None
    gold: str
    correct: bool
    answer_text: str | None = None  # finance: what follows "Answer: " in the decoded text, read for the label


# ----------------------------------------------------------------------------- prompts
def format_example(question: str, choices: list[str]) -> str:
    """FlowerTune's MCQ body: a question mark added unless it ends in '?' or '.', options lettered."""
    if not question.endswith("?") and not question.endswith("."):
        question += "?"
    options = "\n".join(f"{chr(65 + i)}. {c}" for i, c in enumerate(choices))
    return "Question: " + question + "\n\nOptions:\n" + options


def chat_wrap(prompt: str) -> str:
    return f"<|im_start|>question\n{prompt}<|im_end|>\n<|im_start|>answer\n"


def _qa_prompt(instruction: str, body: str) -> str:
    return chat_wrap(f"{instruction}\n{body}\nThe answer is:\n")


def mmlu_items(records: list[dict], category: str) -> list[Item]:
    out = []
    for i, r in enumerate(records):
        options = [str(field(r, k, (str, int, float))) for k in "ABCD"]
        body = format_example(str(field(r, "input", (str, int, float))), options)
        out.append(Item(category, i, _qa_prompt(MMLU_INSTRUCTION, body), str(field(r, "target")), "mcq"))
    return out


def medical_items(name: str, records: list[dict]) -> list[Item]:
    instruction, out = MEDICAL_INSTRUCTIONS[name], []
    for i, r in enumerate(records):
        where = r.get("_where", "record")
        if name == "pubmedqa":
            contexts = field(r, "CONTEXTS", (list, tuple))
            body = "\n".join(str(c) for c in contexts) + "\n" + str(field(r, "QUESTION"))
            gold, kind = str(field(r, "final_decision")), "boolean"
        elif name == "medqa":
            options = field(r, "options", (list, dict))
            if isinstance(options, dict):  # the original release: {"A": text, ...}
                options = [{"key": k, "value": v} for k, v in options.items()]
            body = format_example(str(field(r, "question")), [str(o["value"]) for o in options])
            answer = field(r, "answer")
            keys = [o["key"] for o in options if o["value"] == answer]
            if not keys:
                raise BenchmarkDataError(f"{where}: 'answer' {answer!r} is none of the options")
            gold, kind = str(keys[0]), "mcq"
        else:
            opts = ("opa", "opb", "opc", "opd") if name == "medmcqa" else ("op1", "op2", "op3", "op4")
            body = format_example(
                str(field(r, "question")), [str(field(r, k, (str, int, float))) for k in opts]
            )
            answer = as_int(r, "cop") - (1 if name == "careqa" else 0)
            if answer not in (0, 1, 2, 3):
                raise BenchmarkDataError(
                    f"{where}: field 'cop' is {r['cop']!r}, outside {'1-4' if name == 'careqa' else '0-3'}"
                )
            gold, kind = "ABCD"[answer], "mcq"
        out.append(Item(name, i, _qa_prompt(instruction, body), gold, kind))
    return out


def finance_context(instruction: str, text: str) -> str:
    context = f"Instruction: {instruction}\n"
    if text:
        context += f"Input: {text}\n"
    return context + "Answer: "


def sentiment_label(value: float) -> str:
    """FiQA's score as a label (FlowerTune's ``generate_label``)."""
    return "negative" if value < -0.1 else "neutral" if value < 0.1 else "positive"


def finance_items(name: str, records: list[dict]) -> list[Item]:
    out = []
    if name in ("fpb", "fiqa"):
        records = data.held_out(name, records)
    for i, r in enumerate(records):
        if name == "fpb":
            label = as_int(r, "label")
            text, gold, instruction = (
                str(field(r, "sentence")),
                ["negative", "neutral", "positive"][label],
                FPB_INSTRUCTION,
            )
        elif name == "fiqa":
            score = field(r, "sentiment_score", (int, float))
            tag = "tweet" if r.get("format") == "post" else "news"
            instruction = FPB_INSTRUCTION.replace("news", tag)
            text, gold = str(field(r, "sentence")), sentiment_label(float(score))
        else:
            label = as_int(r, "label")
            text, gold, instruction = (
                str(field(r, "text")),
                ["negative", "positive", "neutral"][label],
                TFNS_INSTRUCTION,
            )
        out.append(Item(name, i, finance_context(instruction, text), gold, "sentiment"))
    return out


def load_items(protocol: str, data_dir: str | None, benchmarks: list[str], limit: int = 0) -> list[Item]:
    """Every question of ``benchmarks`` under ``protocol``, read and checked before any model loads."""
    several = len(benchmarks) > 1
    items: list[Item] = []
    for name in benchmarks:
        if protocol == "flowertune-general-nlp":
            got = mmlu_items(data.mmlu_category(data_dir, name, limit), name)
        else:
            raw = data.raw_records(name, data_dir, several)
            got = medical_items(name, raw) if protocol == "flowertune-medical" else finance_items(name, raw)
            got = got[:limit] if limit else got
        if not got:
            raise BenchmarkDataError(f"{name}: no questions found")
        items += got
    return items


# ----------------------------------------------------------------------------- extraction
def clean_answer(text: str) -> str:
    return text.encode("ascii", "ignore").decode("ascii")


def format_answer(output_full: str, answer: str, answer_type: str = "mcq") -> tuple[str, str]:
    """FlowerTune's ``format_answer``: (prediction, gold), both lower-cased by the caller. The prediction is
    the cleaned answer when it is one of a-e / yes / no, else the whole output."""
    output, default = output_full, (output_full, answer)
    if "\n##" in output:
        output = output.split("\n##")[1].split("\n")[0].strip().lower()
    if "###" in answer:
        try:
            answer = answer.split("answer is:")[1].split("###")[0].strip()
        except IndexError:
            return default
    output = re.sub(r"[^a-zA-Z0-9]", " ", output).strip()
    output = re.sub(" +", " ", output)
    if answer_type == "boolean":
        for pair, one in (("yesyes", "yes"), ("nono", "no"), ("yesno", "yes"), ("noyes", "no")):
            if pair in output:  # FlowerTune checks them in this order and replaces the first found only
                output = output.replace(pair, one)
                break
        output = clean_answer(output)
    elif answer_type == "mcq":
        output = clean_answer(output)
        output = output[0] if output else output
    if output in VALID:
        return output, answer
    return default


def change_target(text: str) -> str:
    """FlowerTune's finance label of a text: positive if it says so, else negative, else neutral."""
    if "positive" in text or "Positive" in text:
        return "positive"
    if "negative" in text or "Negative" in text:
        return "negative"
    return "neutral"


def finance_answer_text(decoded_full: str) -> str:
    """What follows the first "Answer: " of the decoded prompt and generation ("None" without one)."""
    parts = decoded_full.split("Answer: ")
    return parts[1] if len(parts) > 1 else "None"


def score(item: Item, generation: str, decoded_full: str | None = None) -> Record:
    """The item's record: FlowerTune's extraction of ``generation`` and whether it counts as right.

    ``extracted`` is the answer the protocol reads (a letter, yes / no, or a sentiment), or None where
    FlowerTune's extraction finds none (it then compares the whole output, which a gold of "maybe" can
    still equal)."""
    if item.answer_type == "sentiment":
        text = finance_answer_text(decoded_full if decoded_full is not None else item.prompt + generation)
        pred = change_target(text)
        right = pred == change_target(item.gold)
        return Record(item.benchmark, item.index, item.prompt, generation, pred, item.gold, right, text)
    gold = item.gold.lower()
    pred, gold = format_answer(generation.lower(), gold, item.answer_type)
    extracted = pred if pred in VALID or pred == gold else None
    return Record(item.benchmark, item.index, item.prompt, generation, extracted, item.gold, pred == gold)


# ----------------------------------------------------------------------------- generation
def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text)["input_ids"]  # special tokens as ``tokenizer.encode`` adds them (BOS)


def set_budgets(items: list[Item], tokenizer, protocol: str, reference_batch: int, max_length: int) -> None:
    """Each item's new-token budget as FlowerTune's batching gives it (module docstring)."""
    for start in range(0, len(items), reference_batch):
        batch = items[start : start + reference_batch]
        if protocol == "flowertune-finance":
            width = max(len(encode(tokenizer, it.prompt)) for it in batch)
            budget = max(1, max_length - width)
        else:
            budget = max(1, len(tokenizer(batch[0].gold, add_special_tokens=False)["input_ids"]))
        for it in batch:
            it.max_new_tokens = budget


@torch.no_grad()
def generate_batched(
    model, tokenizer, items: list[Item], batch_size: int, progress: bool = False
) -> list[tuple[str, str]]:
    """Greedy generations of every item, in item order: (new text, decoded prompt + new text).

    Items go in batches of one budget, longest prompts first (less padding), left-padded so every row
    continues its own last token."""
    from tqdm.auto import tqdm

    device = next(model.parameters()).device
    ids = [encode(tokenizer, it.prompt) for it in items]
    order = sorted(range(len(items)), key=lambda i: (items[i].max_new_tokens, -len(ids[i])))
    batches, cur = [], []
    for i in order:
        if cur and (len(cur) == batch_size or items[cur[0]].max_new_tokens != items[i].max_new_tokens):
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out: list[tuple[str, str] | None] = [None] * len(items)
    for batch in tqdm(batches, desc="generating", disable=not progress, leave=False):
        width = max(len(ids[i]) for i in batch)
        x = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, i in enumerate(batch):
            x[row, width - len(ids[i]) :] = torch.tensor(ids[i])
            mask[row, width - len(ids[i]) :] = 1
        gen = model.generate(
            input_ids=x.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=items[batch[0]].max_new_tokens,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            pad_token_id=pad,
            eos_token_id=tokenizer.eos_token_id,
        ).cpu()
        for row, i in enumerate(batch):
            new = gen[row, width:].tolist()
            out[i] = (
                tokenizer.decode(new, skip_special_tokens=True),
                tokenizer.decode(ids[i] + new, skip_special_tokens=True),
            )
    return out  # type: ignore[return-value]


@torch.no_grad()
def generate_one_by_one(model, tokenizer, items: list[Item]) -> list[tuple[str, str]]:
    """FlowerTune's loop: one ``generate`` per question (the baseline of the throughput benchmark)."""
    device = next(model.parameters()).device
    out = []
    for it in items:
        x = torch.tensor([encode(tokenizer, it.prompt)], device=device)
        gen = model.generate(
            inputs=x,
            max_new_tokens=it.max_new_tokens,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            pad_token_id=tokenizer.eos_token_id
            if tokenizer.eos_token_id is not None
            else tokenizer.pad_token_id,
        ).cpu()
        new = gen[0, x.shape[1] :].tolist()
        out.append((tokenizer.decode(new, skip_special_tokens=True),
                    tokenizer.decode(x[0].tolist() + new, skip_special_tokens=True)))  # fmt: skip
    return out


def evaluate(
    model,
    tokenizer,
    items: list[Item],
    protocol: str,
    batch_size: int = 16,
    reference_batch: int = 0,
    max_length: int = FINANCE_MAX_LENGTH,
    progress: bool = False,
) -> tuple[dict, list[Record]]:
    """Generate, extract and score ``items``: the per-benchmark and mean accuracy, and every record."""
    by_bench: dict[str, list[Item]] = {}
    for it in items:
        by_bench.setdefault(it.benchmark, []).append(it)
    for group in by_bench.values():  # each benchmark is its own run of the reference, batched from its start
        set_budgets(group, tokenizer, protocol, reference_batch or REFERENCE_BATCH[protocol], max_length)
    t0 = time.perf_counter()
    gens = generate_batched(model, tokenizer, items, batch_size, progress)
    records = [score(it, g, full) for it, (g, full) in zip(items, gens, strict=True)]
    results = {}
    for name in by_bench:
        rs = [r for r in records if r.benchmark == name]
        results[name] = {"accuracy": sum(r.correct for r in rs) / len(rs), "n": len(rs)}
    result = {
        "protocol": protocol,
        "benchmarks": results,
        "average": sum(v["accuracy"] for v in results.values()) / len(results),
        "n": len(records),
        "time_s": time.perf_counter() - t0,
    }
    return result, records


def format_table(result: dict) -> str:
    lines = [f"{result['protocol']}: accuracy (generative, greedy, FlowerTune's extraction)"]
    for name, v in result["benchmarks"].items():
        lines.append(f"  {name:<16} {v['accuracy']:.4f}  ({v['n']} questions)")
    lines.append(f"  {'average':<16} {result['average']:.4f}")
    return "\n".join(lines)


def write_results(path: Path, result: dict, records: list[Record], meta: dict) -> None:
    from eval.mmlu import atomic_write_json

    atomic_write_json(path, {**meta, **result, "records": [asdict(r) for r in records]})


# ----------------------------------------------------------------------------- command line
def benchmarks_of(protocol: str, chosen: list[str] | None) -> list[str]:
    if not chosen:
        return list(BENCHMARKS[protocol])
    bad = [b for b in chosen if b not in CHOICES[protocol]]
    if bad:
        raise BenchmarkDataError(
            f"--benchmarks {','.join(bad)}: not part of {protocol}; valid: {', '.join(CHOICES[protocol])}"
        )
    return chosen


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options the FlowerTune protocols add to an evaluation job."""
    p.add_argument(
        "--protocol",
        default="harness-mmlu",
        choices=PROTOCOLS,
        help="harness-mmlu: log-likelihood MMLU as lm-evaluation-harness scores it (the default); "
        "flowertune-*: the FlowerTune leaderboard's generative evaluations (docs/flowertune.md)",
    )
    p.add_argument(
        "--benchmarks",
        help="flowertune-*: a comma-separated subset (general-nlp: stem, social_sciences, humanities, other; "
        "medical: pubmedqa, medmcqa, medqa, careqa; finance: fpb, fiqa, tfns)",
    )
    p.add_argument(
        "--reference-batch-size",
        type=int,
        default=0,
        help="flowertune-*: the batch size of FlowerTune's run whose generation budgets to reproduce "
        "(0: its default, 16, or 32 for finance)",
    )
    p.add_argument(
        "--max-length",
        type=int,
        default=FINANCE_MAX_LENGTH,
        help="flowertune-finance: total tokens per question, prompt included (FlowerTune: 512)",
    )
    p.add_argument(
        "--quantization",
        default="none",
        choices=["none", "4bit", "8bit"],
        help="load the base with bitsandbytes (the leaderboard evaluates in 4bit: FP4, float32 compute, as "
        "FlowerTune's BitsAndBytesConfig(load_in_4bit=True))",
    )


def run_job(args: argparse.Namespace, items: list[Item], model, tokenizer, is_main: bool = True) -> dict:
    result, records = evaluate(
        model,
        tokenizer,
        items,
        args.protocol,
        batch_size=args.batch_size,
        reference_batch=args.reference_batch_size,
        max_length=args.max_length,
        progress=is_main,
    )
    if is_main:
        print(format_table(result))
        if args.output:
            meta = {
                "model": args.model,
                "adapter": args.adapter,
                "run": getattr(args, "run", None),
                "data": args.data,
                "quantization": args.quantization,
                "reference_batch_size": args.reference_batch_size or REFERENCE_BATCH[args.protocol],
                "max_length": args.max_length,
            }
            write_results(Path(args.output), result, records, meta)
            print(f"results and {len(records)} records written to {args.output}")
        print(json.dumps({k: v for k, v in result.items() if k != "time_s"}))
    return result
