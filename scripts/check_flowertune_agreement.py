"""Does fedllm's FlowerTune evaluation give what FlowerTune's own evaluation code gives?

Runs FlowerTune's code (a fetched copy of adap/flower's ``benchmarks/flowertune-llm/evaluation``, outside
this repository: pass its folder as ``--reference``) and fedllm's ``eval/flowertune.py`` on the same local
benchmark files (``data_prep.flowertune_samples``, or ``--data``) with the same small model, and compares
question by question:

* the prompt each gives the model;
* the generation (FlowerTune: one ``generate`` per question, or its batches of 32 for finance; fedllm:
  its length-sorted, left-padded batches);
* the answer extracted from it and whether it counts as right, and each benchmark's accuracy;
* the extraction alone on a fixed list of awkward generations (letters in words, "\\n##" sections,
  yes/no doubled, "Answer: " twice), through FlowerTune's ``format_answer`` / ``change_target`` and
  fedllm's.

FlowerTune's code loads its data from the Hub and moves tensors to CUDA; here ``datasets.load_dataset``
answers from the local files and the moves to CUDA are no-ops (CPU), nothing else of it is changed.
The last line is one JSON object; the exit status is 1 on any disagreement.

    python scripts/check_flowertune_agreement.py \\
        --reference /path/to/flower/benchmarks/flowertune-llm/evaluation
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eval import flowertune as ft
from eval import flowertune_data as ftd

AWKWARD = [
    "B", " b", "Answer: C", "answer", "(D) because", "\n## Answer\nA. first", "\n##", "", "###", "é B",
    "yes", "Yes.", "yesyes", "noyes", "no no", "maybe", "Maybe", "YESNO", "e", "The answer is D",
]  # fmt: skip
AWKWARD_FINANCE = [
    "positive", "Negative.", "neutral", "x Answer: positive", "negative and positive", "None", "", "POSITIVE",
]  # fmt: skip


@contextlib.contextmanager
def reference(folder: Path):
    """FlowerTune's ``benchmarks`` and ``utils`` modules of one domain, imported fresh."""
    for m in ("benchmarks", "utils"):
        sys.modules.pop(m, None)
    sys.path.insert(0, str(folder))
    try:
        yield importlib.import_module("benchmarks"), importlib.import_module("utils")
    finally:
        sys.path.remove(str(folder))
        for m in ("benchmarks", "utils"):
            sys.modules.pop(m, None)


@contextlib.contextmanager
def on_cpu():
    """FlowerTune's ``.to("cuda")`` and ``.cuda()`` as no-ops."""
    to, cuda = torch.Tensor.to, torch.Tensor.cuda

    def to_cpu(self, *a, **k):
        if a and isinstance(a[0], str) and a[0].startswith("cuda"):
            return self
        return to(self, *a, **k)

    torch.Tensor.to, torch.Tensor.cuda = to_cpu, lambda self, *a, **k: self
    try:
        yield
    finally:
        torch.Tensor.to, torch.Tensor.cuda = to, cuda


def clean(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("_")} for r in records]


def local_hub(data: Path):
    """A ``datasets.load_dataset`` that answers FlowerTune's Hub ids from the local copies."""
    from datasets import Dataset, DatasetDict

    def load(path, name=None, split=None, **_):
        if path == "lukaemon/mmlu":
            recs = [r for c in ftd.MMLU_CATEGORY for r in ftd.mmlu_category(str(data / "mmlu"), c)]
            rows = [
                {k: r[k] for k in ("input", "A", "B", "C", "D", "target")}
                for r in recs
                if r["subset"] == name
            ]
            return (
                Dataset.from_list(rows)
                if rows
                else Dataset.from_dict({k: [] for k in ["input", "A", "B", "C", "D", "target"]})
            )
        bench = next(b for b, (hub, _, _) in ftd.HUB.items() if hub == path)
        domain = "finance" if bench in ("fpb", "fiqa", "tfns") else "medical"
        folder = data / domain / bench
        if bench == "fiqa":
            return DatasetDict(
                {
                    s: Dataset.from_list(clean(ftd._local(folder, s, bench)))
                    for s in ("train", "validation", "test")
                }
            )
        recs = clean(ftd.raw_records(bench, str(data / domain), True))
        if bench in ("fpb", "tfns"):
            return DatasetDict({ftd.HUB[bench][2]: Dataset.from_list(recs)})
        return Dataset.from_list(recs)

    return load


# the real benchmarks' sizes (pauri32/fiqa-2018's three splits, takala/financial_phrasebank sentences_50agree)
HELD_OUT_SIZES = {"fiqa": (938, 117, 118), "fpb": (4846,)}


def held_out_reference(domain_dir: Path) -> dict[str, dict]:
    """Which rows FlowerTune's finance ``load_data`` holds out of FiQA (its three splits concatenated) and FPB
    at their real sizes: the count and the sha256 of the row indices, from its own code on index columns."""
    import hashlib

    import datasets
    from datasets import Dataset, DatasetDict

    out = {}
    saved = datasets.load_dataset
    with reference(domain_dir) as (_, utils_mod):
        try:
            for bench, sizes in HELD_OUT_SIZES.items():
                starts = [sum(sizes[:i]) for i in range(len(sizes))]
                splits = ("train", "validation", "test")[: len(sizes)]
                parts = {
                    s: Dataset.from_dict({"i": list(range(a, a + n))})
                    for s, a, n in zip(splits, starts, sizes, strict=True)
                }
                datasets.load_dataset = lambda *a, parts=parts, **k: DatasetDict(parts)
                rows = utils_mod.load_data("local", concat=len(sizes) > 1)
                idx = [int(v) for v in rows["i"]]
                out[bench] = {
                    "rows": sum(sizes),
                    "held_out": len(idx),
                    "sha256": hashlib.sha256(json.dumps(idx).encode()).hexdigest(),
                }
        finally:
            datasets.load_dataset = saved
    return out


def run_reference(
    domain_dir: Path, data: Path, model, tokenizer, calls: list[tuple]
) -> dict[str, list[dict]]:
    """FlowerTune's ``infer_*`` of each benchmark; returns its per-question rows (prompt, output or label)."""
    import datasets

    captured: dict[str, list[dict]] = {}
    with reference(domain_dir) as (bench_mod, utils_mod), on_cpu(), tempfile.TemporaryDirectory() as tmp:
        load = local_hub(data)
        saved_load = datasets.load_dataset
        datasets.load_dataset = load
        if hasattr(bench_mod, "load_dataset"):
            bench_mod.load_dataset = load

        def capture(name, *rest):
            frame = rest[-2]
            key = rest[0] if len(rest) == 4 and rest[0] else name  # general NLP: the category
            captured[key] = json.loads(frame.to_json(orient="records"))

        bench_mod.save_results = capture
        cwd = os.getcwd()
        os.chdir(tmp)
        try:
            for fn, *args in calls:
                getattr(bench_mod, fn)(model, tokenizer, *args)
        finally:
            os.chdir(cwd)
            datasets.load_dataset = saved_load
        captured["_format_answer"] = getattr(utils_mod, "format_answer", None)
        captured["_change_target"] = getattr(utils_mod, "change_target", None)
    return captured


def compare(protocol: str, ref: dict, ours: list, result: dict, tokenizer) -> dict:
    """Question by question: prompt, generation, extracted answer, correctness; and accuracies."""
    mismatches: dict[str, list] = {"prompt": [], "generation": [], "extracted": [], "accuracy": []}
    for name in result["benchmarks"]:
        rows = ref[name]
        mine = [r for r in ours if r.benchmark == name]
        if len(rows) != len(mine):
            mismatches["prompt"].append((name, f"{len(rows)} reference rows, {len(mine)} ours"))
            continue
        hits = 0
        for row, rec in zip(rows, mine, strict=True):
            if protocol == "flowertune-finance":
                prompt, pred, gold = row["context"], row["new_out"], row["new_target"]
                generation, ours_generation = row["out_text"], rec.answer_text
                ours_pred = rec.extracted
                right = pred == gold
            else:
                prompt = ft.chat_wrap(row["prompt"])
                generation, ours_generation = row["output"], rec.generation
                pred, gold = ref["_format_answer"](
                    row["output"].lower(), row["gold"].lower(), rec_type(rec, row)
                )
                ours_pred = rec.extracted if rec.extracted is not None else rec.generation.lower()
                right = pred == gold
            hits += right
            if prompt != rec.prompt:
                mismatches["prompt"].append((name, rec.index))
            if generation != ours_generation:
                mismatches["generation"].append((name, rec.index, generation, ours_generation))
            if pred != ours_pred or right != rec.correct:
                mismatches["extracted"].append((name, rec.index, pred, ours_pred))
        if abs(hits / len(rows) - result["benchmarks"][name]["accuracy"]) > 1e-12:
            mismatches["accuracy"].append((name, hits / len(rows), result["benchmarks"][name]["accuracy"]))
    return mismatches


def rec_type(rec, row) -> str:
    return "boolean" if rec.benchmark == "pubmedqa" else "mcq"


def awkward(ref: dict, protocol: str) -> list:
    """The extraction alone on awkward generations: FlowerTune's functions against fedllm's."""
    bad = []
    if protocol == "flowertune-finance":
        for g in AWKWARD_FINANCE:
            if ref["_change_target"](g) != ft.change_target(g):
                bad.append(g)
        return bad
    for g in AWKWARD:
        for gold, kind in (("a", "mcq"), ("b", "mcq"), ("yes", "boolean"), ("maybe", "boolean")):
            if ref["_format_answer"](g.lower(), gold, kind) != ft.format_answer(g.lower(), gold, kind):
                bad.append((g, gold, kind))
    return bad


def reference_fixture(protocol: str, ref: dict, result: dict) -> dict:
    """What FlowerTune's code gave, for tests/test_flowertune.py: each prompt's sha256 per benchmark, and its
    extraction of the awkward generations."""
    import hashlib

    out: dict = {"prompts": {}}
    for name in result["benchmarks"]:
        rows = ref[name]
        texts = [
            r["context"] if protocol == "flowertune-finance" else ft.chat_wrap(r["prompt"]) for r in rows
        ]
        out["prompts"][name] = [hashlib.sha256(t.encode()).hexdigest() for t in texts]
    if protocol == "flowertune-finance":
        out["change_target"] = [[g, ref["_change_target"](g)] for g in AWKWARD_FINANCE]
    else:
        out["format_answer"] = [
            [g, gold, kind, *ref["_format_answer"](g.lower(), gold, kind)]
            for g in AWKWARD
            for gold, kind in (("a", "mcq"), ("b", "mcq"), ("yes", "boolean"), ("maybe", "boolean"))
        ]
    return out


def fedllm_held_out() -> dict[str, dict]:
    """The same as :func:`held_out_reference`, from fedllm's ``held_out`` on rows in the same order."""
    import hashlib

    out = {}
    for bench, sizes in HELD_OUT_SIZES.items():
        idx = [r["i"] for r in ftd.held_out(bench, [{"i": i} for i in range(sum(sizes))])]
        out[bench] = {
            "rows": sum(sizes),
            "held_out": len(idx),
            "sha256": hashlib.sha256(json.dumps(idx).encode()).hexdigest(),
        }
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--reference", required=True, help="FlowerTune's benchmarks/flowertune-llm/evaluation folder"
    )
    p.add_argument("--data", help="local benchmark copies as data_prep.flowertune_samples writes them")
    p.add_argument("--batch-size", type=int, default=16, help="fedllm's generation batch")
    p.add_argument("--protocols", default=",".join(ft.BENCHMARKS), help="comma-separated subset")
    p.add_argument("--write-fixture", help="also write the reference's prompts (sha256) and extractions here")
    args = p.parse_args()
    from data_prep.flowertune_samples import write_all
    from fedllm.config import ModelConfig
    from fedllm.model.modeling import load_base

    tmp = tempfile.TemporaryDirectory()
    data = Path(args.data) if args.data else Path(tmp.name)
    if not args.data:
        write_all(data)
    model, tokenizer = load_base(ModelConfig(name="builtin"), "cpu")
    tokenizer.padding_side = "left"  # as Mistral's tokenizer, which FlowerTune's finance batches rely on
    ref_root = Path(args.reference)
    general = ft.BENCHMARKS["flowertune-general-nlp"]
    plans = {  # protocol: (FlowerTune's folder, its calls with its default batch sizes, the local copy)
        "flowertune-general-nlp": (
            "general-nlp",
            [("infer_mmlu", 16, c, "fl") for c in general],
            data / "mmlu",
        ),
        "flowertune-medical": (
            "medical",
            [(f"infer_{b}", 16, "fl") for b in ft.BENCHMARKS["flowertune-medical"]],
            data / "medical",
        ),
        "flowertune-finance": (
            "finance",
            [(f"infer_{b}", 32, "fl") for b in ft.BENCHMARKS["flowertune-finance"]],
            data / "finance",
        ),
    }
    summary, failed = {}, False
    fixture: dict = {}
    for protocol, (domain, calls, local) in plans.items():
        if protocol not in args.protocols.split(","):
            continue
        ref = run_reference(ref_root / domain, data, model, tokenizer, calls)
        items = ft.load_items(protocol, str(local), list(ft.BENCHMARKS[protocol]))
        result, records = ft.evaluate(model, tokenizer, items, protocol, batch_size=args.batch_size)
        mism = compare(protocol, ref, records, result, tokenizer)
        odd = awkward(ref, protocol)
        n_bad = sum(len(v) for v in mism.values()) + len(odd)
        failed |= n_bad > 0
        summary[protocol] = {
            "questions": len(records),
            "prompts_equal": len(records) - len(mism["prompt"]),
            "generations_equal": len(records) - len(mism["generation"]),
            "extracted_equal": len(records) - len(mism["extracted"]),
            "accuracy": {k: v["accuracy"] for k, v in result["benchmarks"].items()},
            "accuracy_mismatches": mism["accuracy"],
            "awkward_checked": len(AWKWARD_FINANCE) if protocol == "flowertune-finance" else 4 * len(AWKWARD),
            "awkward_mismatches": odd,
        }
        fixture[protocol] = reference_fixture(protocol, ref, result)
        if protocol == "flowertune-finance":
            held = held_out_reference(ref_root / domain)
            fixture[protocol]["held_out"] = held
            mine = fedllm_held_out()
            summary["held_out_equal"] = mine == held
            failed |= mine != held
        print(f"{protocol}: {len(records)} questions, {n_bad} disagreement(s)")
        for kind, rows in mism.items():
            for r in rows[:5]:
                print(f"  {kind}: {r}")
    if args.write_fixture:
        Path(args.write_fixture).write_text(json.dumps(fixture, indent=1) + "\n")
    print(json.dumps({"agree": not failed, **summary}))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
