"""Natural Instructions v1 (Mishra et al., ACL 2022): 61 crowdsourced tasks over 10 source datasets.

The tasks come as one folder per task, ``subtaskNNN_<source>_<what>/task.json``, the layout of the
``bigbench==1.0.0`` source archive (``bigbench/benchmark_tasks/natural_instructions``; ``fedllm
prepare-real`` extracts it). A task file holds the task's instruction in ``task_prefix`` ("Definition: ...
Prompt: ...") and its examples as ``{"input": str, "target": [str, ...]}`` (one or more references).

Mapped into the one schema: the task's instruction is the instruction, the example's input the input, its
first reference the response, and ``category`` is the task's name, so a partition by task or by source
dataset (``data.partition=by_task`` / ``by_source``) sees it. Federated instruction-tuning papers split
this data that way (FedKSeed: a client per task group, held-out *tasks* scored by Rouge-L), which gives
real, natural non-IID clients. Every reference is kept for the Rouge-L of held-out tasks (the best over
them, as Natural Instructions scores).

Imports nothing from fedllm (``data_prep`` stands alone).
"""

from __future__ import annotations

import json
import os
import random
import re
from dataclasses import dataclass
from pathlib import Path

from data_prep.schema import DataError, Example, read_text

NAME = "natural-instructions"
TASK_FILE = "task.json"
# source names as the task folders spell them -> one name per source dataset
SOURCE_ALIASES = {"miscellaneous": "misc", "miscellaenous": "misc"}
_TASK = re.compile(r"^subtask\d{3}_([a-z]+)_")
EXPECTED = (
    "a Natural Instructions folder: subtaskNNN_<source>_<name>/task.json files (fedllm prepare-real "
    "--natural-instructions --bigbench-archive FILE extracts them from bigbench 1.0.0's source archive)"
)


@dataclass(frozen=True)
class Reference:
    """A held-out example: what the model is asked, and every acceptable answer."""

    example: Example
    references: tuple[str, ...]


def default_folder() -> Path:
    """Where ``fedllm prepare-real`` puts the tasks: ``$FEDLLM_CACHE/natural-instructions``."""
    cache = Path(os.environ.get("FEDLLM_CACHE", Path.home() / ".cache" / "fedllm"))
    return cache / NAME


def resolve(dataset: str) -> Path | None:
    """The task folder ``dataset`` names ('natural-instructions', or a folder of task folders); None when
    ``dataset`` is not Natural Instructions."""
    if dataset == NAME:
        folder = default_folder()
        if not folder.is_dir():
            raise DataError(
                f"data.dataset = {NAME}: {folder} does not exist; prepare it from a bigbench-1.0.0.tar.gz "
                "(the package index no longer serves it) with fedllm prepare-real --natural-instructions "
                "--bigbench-archive FILE, or give data.dataset a folder of subtask*/task.json"
            )
        return folder
    path = Path(dataset).expanduser()
    if path.is_dir() and any(path.glob(f"subtask*/{TASK_FILE}")):
        return path
    return None


def source_of(task: str) -> str:
    """The source dataset of a task, from its name (``subtask026_drop_question_generation`` -> ``drop``)."""
    m = _TASK.match(task)
    if not m:
        raise DataError(f"{task}: not a Natural Instructions task name (subtaskNNN_<source>_<name>)")
    return SOURCE_ALIASES.get(m.group(1), m.group(1))


def task_names(folder: Path) -> list[str]:
    names = sorted(p.parent.name for p in Path(folder).glob(f"subtask*/{TASK_FILE}"))
    if not names:
        raise DataError(f"{folder}: no subtask*/{TASK_FILE}; expected {EXPECTED}")
    return names


def select_tasks(folder: Path, patterns: list[str]) -> list[str]:
    """The tasks whose name contains one of ``patterns`` (a name, a number such as ``subtask026``, or a
    source such as ``drop``); every pattern must match something."""
    names = task_names(folder)
    out = []
    for pat in patterns:
        hit = [n for n in names if pat == n or n.startswith(pat + "_") or source_of(n) == pat]
        if not hit:
            raise DataError(
                f"data.heldout_tasks: {pat!r} matches no task of {folder} (give a task name, its subtaskNNN "
                "prefix, or a source dataset such as drop)"
            )
        out += [n for n in hit if n not in out]
    return out


def _read_task(folder: Path, task: str) -> tuple[str, list[dict]]:
    path = Path(folder) / task / TASK_FILE
    try:
        data = json.loads(read_text(path, EXPECTED))
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(data, dict) or not isinstance(data.get("examples"), list):
        raise DataError(f"{path}: expected an object with a list 'examples'; {EXPECTED}")
    prefix = data.get("task_prefix")
    if not isinstance(prefix, str) or not prefix.strip():
        raise DataError(f"{path}: field 'task_prefix' must be a non-empty string (the task's instruction)")
    return prefix, data["examples"]


def _references(record, where: str) -> tuple[str, tuple[str, ...]]:
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    text, target = record.get("input"), record.get("target")
    if not isinstance(text, str):
        raise DataError(f"{where}: field 'input' must be a string, got {type(text).__name__}")
    refs = (target,) if isinstance(target, str) else tuple(target) if isinstance(target, list) else ()
    refs = tuple(r for r in refs if isinstance(r, str) and r.strip())
    if not refs:
        raise DataError(
            f"{where}: field 'target' must be a non-empty string or list of strings, got {target!r}"
        )
    return text, refs


def load_task(folder: Path, task: str, per_task: int = 0, seed: int = 0) -> list[Reference]:
    """A task's examples with their references; ``per_task`` > 0: a seeded sample of that many (the file
    order groups similar examples, so the first N would not be representative)."""
    prefix, records = _read_task(folder, task)
    order = list(range(len(records)))
    if per_task and per_task < len(order):
        order = sorted(random.Random(f"{seed}/{task}").sample(order, per_task))
    out = []
    for i in order:
        text, refs = _references(records[i], f"{Path(folder) / task / TASK_FILE}, example {i}")
        out.append(Reference(Example(prefix, text, refs[0], task), refs))
    return out


def load(
    folder: Path,
    tasks: list[str] | None = None,
    exclude: list[str] | None = None,
    per_task: int = 0,
    seed: int = 0,
) -> list[Reference]:
    """The examples of ``tasks`` (default: every task) but ``exclude``, in task order."""
    names = tasks if tasks is not None else task_names(folder)
    skip = set(exclude or [])
    return [r for t in names if t not in skip for r in load_task(folder, t, per_task, seed)]
