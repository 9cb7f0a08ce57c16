"""The FlowerTune leaderboard's evaluation sets, read from local copies in their published layouts or
from the Hub ids FlowerTune's evaluation code loads.

Each benchmark becomes a list of records with the fields FlowerTune's code reads, in its order (the
order matters: FlowerTune's generation budget is set per batch of its questions). A local benchmark is a
folder (``--data DIR``: ``DIR/<benchmark>/`` for a protocol of several, or ``DIR`` itself for one
benchmark) holding the split FlowerTune uses as any of::

    <split>.jsonl  <split>.json  <split>.parquet  <split>.csv  <split>-*.parquet  data/<split>-*.parquet
    <split>/*.parquet  <config>/<split>-*.parquet

plus each release's own file where it has one (the original MMLU CSVs ``data/test/<subject>_test.csv``
or lukaemon/mmlu's ``<subject>/test-*.parquet``; PubMedQA's ``test_set.json`` keyed by PubMed id;
MedMCQA's ``dev.json`` with answers 1-4; TFNS's ``sent_valid.csv``; the Financial PhraseBank's
``Sentences_50Agree.txt``). A missing field or an unreadable file is one line naming the file, the row
and the field.
"""

from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path

from eval.mmlu_data import MMLUDataError, load_questions


class BenchmarkDataError(MMLUDataError):
    """A FlowerTune benchmark file that is missing, unreadable or lacks a field (file, row, field)."""


# FlowerTune's general-NLP categories (benchmarks/flowertune-llm/evaluation/general-nlp/benchmarks.py),
# in its order: the order of the questions within a category's run.
MMLU_CATEGORY: dict[str, list[str]] = {
    "stem": [
        "abstract_algebra", "anatomy", "astronomy", "college_biology", "college_chemistry",
        "college_computer_science", "college_mathematics", "college_physics", "computer_security",
        "conceptual_physics", "electrical_engineering", "elementary_mathematics", "high_school_biology",
        "high_school_chemistry", "high_school_computer_science", "high_school_mathematics",
        "high_school_physics", "high_school_statistics", "machine_learning",
    ],
    "social_sciences": [
        "econometrics", "high_school_geography", "high_school_government_and_politics",
        "high_school_macroeconomics", "high_school_microeconomics", "high_school_psychology",
        "human_sexuality", "professional_psychology", "public_relations", "security_studies", "sociology",
        "us_foreign_policy",
    ],
    "humanities": [
        "formal_logic", "high_school_european_history", "high_school_us_history",
        "high_school_world_history", "international_law", "jurisprudence", "logical_fallacies",
        "moral_disputes", "moral_scenarios", "philosophy", "prehistory", "professional_law",
        "world_religions",
    ],
    "other": [
        "business_ethics", "clinical_knowledge", "college_medicine", "global_facts", "human_aging",
        "management", "marketing", "medical_genetics", "miscellaneous", "nutrition",
        "professional_accounting", "professional_medicine", "virology",
    ],
}  # fmt: skip

# benchmark -> (Hub id, Hub config, split FlowerTune evaluates, release-specific file names)
HUB: dict[str, tuple[str, str | None, str]] = {
    "pubmedqa": ("bigbio/pubmed_qa", "pubmed_qa_labeled_fold0_source", "test"),
    "medqa": ("bigbio/med_qa", "med_qa_en_4options_source", "test"),
    "medmcqa": ("medmcqa", None, "validation"),
    "careqa": ("HPAI-BSC/CareQA", "CareQA_en", "test"),
    "fpb": ("takala/financial_phrasebank", "sentences_50agree", "train"),
    "fiqa": ("pauri32/fiqa-2018", None, "all"),
    "tfns": ("zeroshot/twitter-financial-news-sentiment", None, "validation"),
}
RELEASE_FILES = {
    "pubmedqa": ["test_set.json"],
    "medmcqa": ["dev.json"],
    "tfns": ["sent_valid.csv"],
    "fpb": ["Sentences_50Agree.txt"],
}


def _read_records(path: Path) -> list[dict]:
    from data_prep.schema import check_readable, read_text

    what = "a .jsonl, .json, .parquet or .csv file of benchmark records"
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        check_readable(path, what, BenchmarkDataError)
        try:
            return pq.read_table(path).to_pylist()
        except Exception as e:  # pyarrow raises several types for corrupt files
            raise BenchmarkDataError(f"{path}: not a readable parquet file ({e})") from None
    if suffix == ".txt":  # the Financial PhraseBank release: "sentence@label" lines, Latin-1
        check_readable(path, what, BenchmarkDataError)
        names = {"negative": 0, "neutral": 1, "positive": 2}
        out = []
        for i, line in enumerate(path.read_text(encoding="iso-8859-1").splitlines()):
            if not line.strip():
                continue
            sentence, sep, label = line.rpartition("@")
            if not sep or label.strip() not in names:
                raise BenchmarkDataError(
                    f"{path}, line {i + 1}: expected 'sentence@label' (label negative, neutral or positive)"
                )
            out.append({"sentence": sentence, "label": names[label.strip()]})
        return out
    text = read_text(path, what, BenchmarkDataError)
    if suffix == ".csv":  # integer columns as integers, as the datasets library reads a CSV
        return [
            {k: int(v) if _is_int(v) else v for k, v in row.items()}
            for row in csv.DictReader(io.StringIO(text, newline=""))
        ]
    if suffix == ".jsonl":
        return _read_records_lines(text, path)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        # MedMCQA's dev.json is one record per line despite its name
        if "Extra data" in e.msg:
            return _read_records_lines(text, path)
        raise BenchmarkDataError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    if isinstance(data, dict):  # PubMedQA's release: {pubid: record}
        return [{"pubid": k, **v} for k, v in data.items()]
    if not isinstance(data, list):
        raise BenchmarkDataError(f"{path}: expected a list of records, got {type(data).__name__}")
    return data


def _is_int(v) -> bool:
    return isinstance(v, str) and v.strip().lstrip("-").isdigit()


def _read_records_lines(text: str, path: Path) -> list[dict]:
    out = []
    for i, line in enumerate(text.splitlines()):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise BenchmarkDataError(f"{path}, line {i + 1}: not valid JSON ({e.msg})") from None
    return out


def split_files(folder: Path, split: str, release: list[str] = ()) -> list[Path]:
    """The files of ``split`` in ``folder``, in the first layout that has any (see the module docstring)."""
    for pattern in (
        *release,
        f"{split}.jsonl", f"{split}.json", f"{split}.parquet", f"{split}.csv", f"{split}-*.parquet",
        f"data/{split}-*.parquet", f"{split}/*.parquet", f"*/{split}-*.parquet",
    ):  # fmt: skip
        found = sorted(folder.glob(pattern))
        if found:
            return found
    return []


def _local(folder: Path, split: str, name: str) -> list[dict]:
    files = split_files(folder, split, RELEASE_FILES.get(name, []))
    if not files:
        raise BenchmarkDataError(
            f"{folder}: no '{split}' split of {name} found (looked for {split}.jsonl, {split}.json, "
            f"{split}.parquet, {split}.csv, {split}-*.parquet, {split}/*.parquet"
            + "".join(f", {f}" for f in RELEASE_FILES.get(name, []))
            + ")"
        )
    out = []
    for f in files:
        recs = _read_records(f)
        if f.name == "dev.json" and name == "medmcqa":  # the original release counts answers from 1
            recs = [{**r, "cop": int(r["cop"]) - 1} if "cop" in r else r for r in recs]
        out += [{**r, "_where": f"{f}, row {i}"} for i, r in enumerate(recs)]
    return out


def _hub(name: str, split: str) -> list[dict]:
    import datasets

    hub_id, config, _ = HUB[name]
    try:
        if split == "all":  # FiQA: FlowerTune concatenates train, validation and test
            ds = datasets.load_dataset(hub_id, config)
            rows = [r for s in ("train", "validation", "test") for r in ds[s]]
        else:
            rows = list(datasets.load_dataset(hub_id, config, split=split))
    except Exception as e:  # datasets raises many types for offline / missing
        offline = os.environ.get("HF_DATASETS_OFFLINE") == "1" or os.environ.get("HF_HUB_OFFLINE") == "1"
        hint = " (offline: pass a local copy with --data)" if offline else ""
        raise BenchmarkDataError(f"{name}: cannot load {hub_id!r} from the Hub{hint}: {e}") from None
    return [{**r, "_where": f"{hub_id}, row {i}"} for i, r in enumerate(rows)]


def benchmark_folder(data: str | None, name: str, several: bool) -> Path | None:
    """Where ``name``'s local copy lies under ``--data`` (None: the Hub)."""
    if data in (None, "", "hub"):
        return None
    root = Path(data).expanduser()
    if not root.is_dir():
        raise BenchmarkDataError(
            f"--data {data}: not a folder (expected a local copy of the benchmark files)"
        )
    if (root / name).is_dir():
        return root / name
    if several:
        raise BenchmarkDataError(f"--data {data}: no folder '{name}' in it (one folder per benchmark)")
    return root


def raw_records(name: str, data: str | None, several: bool) -> list[dict]:
    """``name``'s records in FlowerTune's order, before its post-processing."""
    folder = benchmark_folder(data, name, several)
    split = HUB[name][2]
    if folder is None:
        return _hub(name, split)
    if split == "all":
        return [
            r for s in ("train", "validation", "test") for r in _local_optional(folder, s, name)
        ] or _local(folder, "train", name)
    return _local(folder, split, name)


def _local_optional(folder: Path, split: str, name: str) -> list[dict]:
    return _local(folder, split, name) if split_files(folder, split, []) else []


def field(rec: dict, key: str, kind: type | tuple = str) -> object:
    """``rec[key]`` of the expected type, or one line naming the file, row and field."""
    where = rec.get("_where", "record")
    if key not in rec or rec[key] is None:
        raise BenchmarkDataError(f"{where}: missing field '{key}'")
    value = rec[key]
    if not isinstance(value, kind):
        want = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise BenchmarkDataError(f"{where}: field '{key}' must be {want}, got {type(value).__name__}")
    return value


def as_int(rec: dict, key: str) -> int:
    value = field(rec, key, (int, str, float))
    try:
        return int(value)
    except ValueError:
        raise BenchmarkDataError(
            f"{rec.get('_where', 'record')}: field '{key}' is not a number: {value!r}"
        ) from None


# the share of FPB and FiQA FlowerTune scores: its finance ``utils.load_data`` (adap/flower, benchmarks/
# flowertune-llm/evaluation/finance, since 13d315a of 2024-08-23) takes train_test_split(0.25, seed=42) of
# both, FiQA's three splits concatenated first. Its first version (finance/fiqa.py, July-August 2024) and
# FinGPT's benchmarks took 0.226 of FiQA (266 of 1,173 rows instead of 294): not what the leaderboard's code
# runs now. scripts/check_flowertune_agreement.py checks the rows against that code at the real sizes.
HELD_OUT_SHARE = {"fpb": 0.25, "fiqa": 0.25}


def held_out(bench: str, records: list[dict]) -> list[dict]:
    """The rows of ``bench`` (fpb or fiqa) FlowerTune's evaluation scores: ``train_test_split(share,
    seed=42)["test"]`` of the datasets library, on the rows in their order (the library's own call, so the
    same rows)."""
    from datasets import Dataset

    share = HELD_OUT_SHARE[bench]
    idx = Dataset.from_dict({"i": list(range(len(records)))}).train_test_split(share, seed=42)["test"]["i"]
    return [records[i] for i in idx]


def mmlu_category(data: str | None, category: str, limit: int = 0) -> list[dict]:
    """A category's MMLU test questions as FlowerTune reads ``lukaemon/mmlu``: its subjects in its order,
    each subject's questions in file order (fields input, A, B, C, D, target)."""
    if category not in MMLU_CATEGORY:
        raise BenchmarkDataError(f"MMLU category {category!r} is unknown; valid: {', '.join(MMLU_CATEGORY)}")
    subjects = MMLU_CATEGORY[category]
    if data in (None, "", "hub"):
        return _mmlu_hub(subjects, limit)
    root = Path(data).expanduser()
    lukaemon = [root / s for s in subjects if split_files(root / s, "test")]
    if lukaemon:  # lukaemon/mmlu's parquet conversion: <subject>/test-*.parquet with input, A-D, target
        out = []
        for s in subjects:
            recs = _local(root / s, "test", "mmlu") if (root / s).is_dir() else []
            out += [{**r, "subset": s} for r in (recs[:limit] if limit else recs)]
        return out
    present = {q.subject for q in load_questions(str(root), "test")}
    chosen = [s for s in subjects if s in present]
    if not chosen:
        raise BenchmarkDataError(f"--data {data}: none of the {category} subjects ({subjects[0]}, ...) found")
    qs = load_questions(str(root), "test", chosen, limit)
    by_subject: dict[str, list] = {}
    for q in qs:
        by_subject.setdefault(q.subject, []).append(q)
    return [
        {"input": q.question, "A": q.choices[0], "B": q.choices[1], "C": q.choices[2], "D": q.choices[3],
         "target": "ABCD"[q.answer], "subset": s, "_where": f"{root}, {s}, question {q.index}"}
        for s in chosen for q in by_subject.get(s, [])
    ]  # fmt: skip


def _mmlu_hub(subjects: list[str], limit: int) -> list[dict]:
    import datasets

    out = []
    for s in subjects:
        try:
            rows = list(datasets.load_dataset("lukaemon/mmlu", s, split="test"))
        except Exception as e:  # datasets raises many types for offline / missing
            raise BenchmarkDataError(
                f"lukaemon/mmlu {s}: cannot load from the Hub ({e}); pass --data"
            ) from None
        rows = rows[:limit] if limit else rows
        out += [{**r, "subset": s, "_where": f"lukaemon/mmlu {s}, row {i}"} for i, r in enumerate(rows)]
    return out
