"""Load Dolly, Alpaca, Wizard (Hub or local json/jsonl/parquet) into :class:`Example`.

Field layouts:

=========  ==========================================================
dolly      instruction, context, response, category   (databricks/databricks-dolly-15k)
alpaca     instruction, input, output                 (tatsu-lab/alpaca)
wizard     instruction, output                        (WizardLMTeam/WizardLM_evol_instruct_70k)
fedllm     instruction, input, response, category     (this project's own schema)
=========  ==========================================================

FlowerTune's four leaderboard datasets all have the fields instruction, input,
output, so their layout cannot be told from the fields; each is mapped the way
FlowerTune's templates map it (``reformat`` in ``examples/flowertune-llm-*``),
chosen by ``data.format`` or by the dataset's Hub id:

========================  ========================================  ===================================
format                    dataset                                   instruction the model sees
========================  ========================================  ===================================
flowertune-general-nlp    flwrlabs/alpaca-gpt4                      instruction (input is dropped)
flowertune-finance        flwrlabs/fingpt-sentiment-train           instruction + " " + input
flowertune-medical        flwrlabs/medical-meadow-medical-flashcards  input (instruction is dropped)
flowertune-code           flwrlabs/code-alpaca-20k                  instruction + " " + input
========================  ========================================  ===================================

``format="auto"`` picks the layout from the fields of the first record. Every
record is checked: a missing or empty required field is reported with the
file, the line (jsonl) or row (json, parquet) and the field name.
"""

from __future__ import annotations

import json
import logging
import os
import random
from collections.abc import Iterable
from pathlib import Path

from data_prep.schema import DataError, Example, check_readable, jsonl_records, read_text

log = logging.getLogger(__name__)

HUB_IDS = {
    "dolly": "databricks/databricks-dolly-15k",
    "alpaca": "tatsu-lab/alpaca",
    "wizard": "WizardLMTeam/WizardLM_evol_instruct_70k",
}
# FlowerTune's leaderboard datasets: the layout each Hub id is read with (see the module docstring)
FLOWERTUNE_FORMATS = {
    "flwrlabs/alpaca-gpt4": "flowertune-general-nlp",
    "flwrlabs/fingpt-sentiment-train": "flowertune-finance",
    "flwrlabs/medical-meadow-medical-flashcards": "flowertune-medical",
    "flwrlabs/code-alpaca-20k": "flowertune-code",
}
# every name ``data.dataset`` takes besides a Hub id, a file or a folder: what ``load_examples`` dispatches on
# and what ``fedllm run --help-config`` lists (one place for both)
NAMED_DATASETS = {
    "builtin": "the built-in offline skills, the default",
    "testbed": "the built-in testbed of skills where methods can differ (docs/testbed.md)",
    "sharegpt": "ShareGPT V3's multi-turn conversations (fedllm prepare-real)",
    "natural-instructions": "Natural Instructions v1's tasks (fedllm prepare-real --natural-instructions)",
    **{name: f"{hub_id} from the Hub" for name, hub_id in HUB_IDS.items()},
    **{
        hub_id: f"FlowerTune's {fmt[len('flowertune-') :]} data from the Hub"
        for hub_id, fmt in FLOWERTUNE_FORMATS.items()
    },
}
DATASET_HELP = (
    ", ".join(f"'{name}' ({what})" for name, what in NAMED_DATASETS.items())
    + "; or any Hub id, a .json/.jsonl/.parquet file (instruction layouts, or ShareGPT's conversations), "
    "or a folder of Natural Instructions' subtask*/task.json"
)
FORMATS = ("auto", "dolly", "alpaca", "wizard", "fedllm", *FLOWERTUNE_FORMATS.values())
# format -> (instruction, input, response, category); None: absent from the layout
LAYOUTS: dict[str, tuple[str, str | None, str, str | None]] = {
    "dolly": ("instruction", "context", "response", "category"),
    "alpaca": ("instruction", "input", "output", None),
    "wizard": ("instruction", None, "output", None),
    "fedllm": ("instruction", "input", "response", "category"),
}


def holds_conversations(path: Path) -> bool:
    """Whether a JSON / jsonl file's first record has ShareGPT's layout (read from its first 64 kB)."""
    from data_prep.sharegpt import is_sharegpt

    with open(path, encoding="utf-8", errors="replace") as fh:
        head = fh.read(65536).lstrip()
    if head.startswith("["):
        head = head[1:].lstrip()
    try:
        first, _ = json.JSONDecoder().raw_decode(head)
    except json.JSONDecodeError:  # a first record longer than what was read: its keys tell
        return head.startswith("{") and '"conversations"' in head and '"from"' in head
    return is_sharegpt(first)


def detect_format(record: dict, where: str) -> str:
    keys = set(record)
    if {"instruction", "context", "response"} <= keys:
        return "dolly"
    if {"instruction", "response"} <= keys:
        return "fedllm"
    if {"instruction", "input", "output"} <= keys:
        return "alpaca"
    if {"instruction", "output"} <= keys:
        return "wizard"
    raise DataError(
        f"{where}: cannot tell the dataset format from fields {sorted(keys)}; expected dolly "
        "(instruction, context, response), alpaca (instruction, input, output) or wizard (instruction, "
        "output)"
    )


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _flowertune_example(record: dict, fmt: str, where: str) -> Example:
    """A FlowerTune record as its template reads it: the texts are kept exactly (no stripping), since the
    template's prompt is built from them as they are."""
    needed = ("instruction", "input", "output")
    for f in needed:
        if f not in record:
            raise DataError(
                f"{where}: missing required field '{f}' ({fmt} format: instruction, input, output)"
            )
        if not isinstance(record[f], str):
            raise DataError(f"{where}: field '{f}' must be a string, got {type(record[f]).__name__}")
        if not _encodable(record[f]):
            raise DataError(f"{where}: field '{f}' holds text that is not valid Unicode")
    if fmt == "flowertune-medical":
        instruction = record["input"]
    elif fmt in ("flowertune-finance", "flowertune-code"):
        instruction = record["instruction"] + " " + record["input"]
    else:
        instruction = record["instruction"]
    for name, value in (
        ("instruction" if fmt != "flowertune-medical" else "input", instruction),
        ("output", record["output"]),
    ):
        if not value.strip():
            raise DataError(f"{where}: field '{name}' must be a non-empty string ({fmt} format)")
    return Example(instruction, "", record["output"], None)


def to_example(record: dict, fmt: str, where: str) -> Example:
    """Map one record to the schema; ``where`` is 'file, line N' for messages."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if fmt.startswith("flowertune-"):
        return _flowertune_example(record, fmt, where)
    inst_f, input_f, resp_f, cat_f = LAYOUTS[fmt]
    for f in (inst_f, resp_f):
        value = record.get(f)
        if f not in record:
            raise DataError(f"{where}: missing required field '{f}' ({fmt} format)")
        if not isinstance(value, str) or not value.strip():
            raise DataError(f"{where}: field '{f}' must be a non-empty string, got {value!r}")
    for f in (inst_f, input_f, resp_f):
        value = record.get(f) if f else None
        if isinstance(value, str) and not _encodable(value):
            raise DataError(
                f"{where}: field '{f}' holds text that is not valid Unicode (a lone surrogate, e.g. "
                "from a JSON \\ud800 escape)"
            )
    extra = record.get(input_f) if input_f else ""
    if extra is not None and not isinstance(extra, str):
        raise DataError(f"{where}: field '{input_f}' must be a string, got {type(extra).__name__}")
    category = record.get(cat_f) if cat_f else None
    return Example(record[inst_f], extra or "", record[resp_f], str(category) if category else None)


EXPECTED_FILE = "a .json, .jsonl or .parquet file of instruction records (dolly, alpaca or wizard fields)"


def _records_from_file(path: Path) -> Iterable[tuple[dict, str]]:
    suffix = path.suffix.lower()
    if suffix not in (".json", ".jsonl", ".parquet"):
        raise DataError(f"{path}: unsupported file type '{suffix}'; expected .json, .jsonl or .parquet")
    if suffix == ".jsonl":
        yield from jsonl_records(read_text(path, EXPECTED_FILE), path)
    elif suffix == ".json":
        try:
            data = json.loads(read_text(path, EXPECTED_FILE))
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
        if not isinstance(data, list):
            raise DataError(f"{path}: expected a JSON list of records, got {type(data).__name__}")
        for i, rec in enumerate(data):
            yield rec, f"{path}, record {i}"
    else:
        import pyarrow.parquet as pq

        check_readable(path, EXPECTED_FILE)
        try:
            table = pq.read_table(path)
        except Exception as e:  # pyarrow raises several types for corrupt or truncated files
            raise DataError(f"{path}: not a readable parquet file ({e}); expected {EXPECTED_FILE}") from None
        for i, rec in enumerate(table.to_pylist()):
            yield rec, f"{path}, row {i}"


def _records_from_hub(hub_id: str) -> Iterable[tuple[dict, str]]:
    from datasets import load_dataset

    try:
        ds = load_dataset(hub_id, split="train")
    except Exception as e:  # datasets raises many types for offline / missing
        offline = os.environ.get("HF_DATASETS_OFFLINE") == "1" or os.environ.get("HF_HUB_OFFLINE") == "1"
        hint = (
            "; offline mode is on: download it first or pass a local .json/.jsonl/.parquet file"
            if offline
            else ""
        )
        raise DataError(
            f"data.dataset: cannot load {hub_id!r} from the Hub{hint} ({type(e).__name__})"
        ) from None
    for i, rec in enumerate(ds):
        yield rec, f"{hub_id}, row {i}"


def load_examples(
    dataset: str,
    fmt: str = "auto",
    max_examples: int = 0,
    builtin_per_skill: int = 400,
    seed: int = 0,
    per_task: int = 0,
    exclude_tasks: list[str] | None = None,
) -> list[Example]:
    """Examples of ``dataset``: 'builtin', 'testbed', 'natural-instructions' (or a folder of its tasks), a
    short name, a Hub id or a local file. ``per_task`` and ``exclude_tasks``: Natural Instructions only (a
    seeded sample of each task; tasks held out for evaluation)."""
    return load_examples_and_rest(
        dataset, fmt, max_examples, builtin_per_skill, seed, per_task, exclude_tasks
    )[0]


def sample(examples: list[Example], max_examples: int, seed: int) -> tuple[list[Example], list[Example]]:
    """A seeded sample of ``max_examples`` of ``examples`` in their order, and the examples it leaves out
    (all of them kept, none left, when ``max_examples`` is 0 or not smaller)."""
    if not 0 < max_examples < len(examples):
        return examples, []
    keep = set(random.Random(seed).sample(range(len(examples)), max_examples))
    return (
        [e for i, e in enumerate(examples) if i in keep],
        [e for i, e in enumerate(examples) if i not in keep],
    )


def load_examples_and_rest(
    dataset: str,
    fmt: str = "auto",
    max_examples: int = 0,
    builtin_per_skill: int = 400,
    seed: int = 0,
    per_task: int = 0,
    exclude_tasks: list[str] | None = None,
) -> tuple[list[Example], list[Example]]:
    """:func:`load_examples`, and the examples ``max_examples`` left out of a seeded sample (ShareGPT,
    Natural Instructions; empty where the loader takes the first ones, or all): where a validation split
    comes from without moving a single example of the sample (``fedllm.federation_data``)."""
    from data_prep import natural_instructions as ni

    folder = ni.resolve(dataset) if dataset not in ("builtin", "testbed") else None
    if folder is not None:
        every = [r.example for r in ni.load(folder, exclude=exclude_tasks, per_task=per_task, seed=seed)]
        examples, left = sample(every, max_examples, seed)
        tasks = len({e.category for e in examples})
        log.info(
            "data.dataset %s: %d examples of %d tasks (Natural Instructions)", folder, len(examples), tasks
        )
        return examples, left
    if dataset == "testbed":
        from data_prep import testbed

        exclude = {r["question"] for r in testbed.benchmark()}
        examples = testbed.instruction_examples(builtin_per_skill, seed=seed, exclude_prompts=exclude)
        return (examples[:max_examples], examples[max_examples:]) if max_examples else (examples, [])
    if dataset == "builtin":
        from data_prep import builtin_skills

        exclude = builtin_skills.benchmark_prompts(builtin_skills.benchmark())
        examples = builtin_skills.instruction_examples(builtin_per_skill, seed=seed, exclude_prompts=exclude)
        return (examples[:max_examples], examples[max_examples:]) if max_examples else (examples, [])
    if dataset == "sharegpt":  # the prepared file (fedllm prepare-real --sharegpt)
        from data_prep import sharegpt

        dataset = str(sharegpt.prepared_file())
    path = Path(dataset).expanduser()
    if path.suffix.lower() in (".json", ".jsonl") and path.is_file() and holds_conversations(path):
        from data_prep import sharegpt

        every = sharegpt.conversations(sharegpt.read_records(path), str(path))
        examples, left = sample(every, max_examples, seed)
        log.info("data.dataset %s: %d conversations (ShareGPT layout)", path, len(examples))
        return examples, left
    if (
        path.suffix.lower() in (".json", ".jsonl", ".parquet")
        or (os.sep in dataset and dataset.count("/") != 1)
        or path.exists()
    ):
        try:
            check_readable(path, EXPECTED_FILE)
        except DataError as e:
            raise DataError(f"data.dataset: {e}") from None
        records = _records_from_file(path)
    else:
        records = _records_from_hub(HUB_IDS.get(dataset, dataset))
        if fmt == "auto" and dataset in HUB_IDS:
            fmt = dataset
        if fmt == "auto" and dataset in FLOWERTUNE_FORMATS:
            fmt = FLOWERTUNE_FORMATS[dataset]
    auto = fmt == "auto"
    out = []
    for rec, where in records:
        layout = detect_format(rec, where) if fmt == "auto" else fmt
        fmt = layout
        out.append(to_example(rec, layout, where))
        if max_examples and len(out) >= max_examples:
            break
    if not out:
        raise DataError(f"data.dataset: {dataset} holds no records")
    log.info(
        "data.dataset %s: %d records, %s format%s", dataset, len(out), fmt, " (detected)" if auto else ""
    )
    return out, []
