"""The one instruction schema every loader maps into.

Dolly, Alpaca and Wizard name their fields differently; the rest of the
pipeline only ever sees :class:`Example`, so prompt building and partitioning
are written once.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


class DataError(ValueError):
    """Bad input data: the message names the file, line/row and field."""


@dataclass(frozen=True)
class Example:
    """One instruction-following example.

    ``category`` drives non-IID partitioning; datasets without categories get
    ``None`` and the partitioner falls back as documented in ``partition.py``.
    ``turns``: a multi-turn conversation's (role, text) turns (``data_prep/sharegpt.py``), trained through
    the chat template with the loss on the assistant's turns; then ``instruction`` is its first user turn
    and ``response`` its first answer. ``group``: the source several examples share (the chat a ShareGPT
    record is one part of), which every split keeps whole, so a held-out example never has a part of its
    source in training.
    """

    instruction: str
    input: str
    response: str
    category: str | None = None
    turns: tuple[tuple[str, str], ...] = ()
    group: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def check_readable(path: Path, expected: str, error: type[Exception] = DataError) -> Path:
    """``path`` if it is a file this process can read; else ``error`` naming it and what was expected."""
    if not path.exists():
        raise error(f"{path} does not exist; expected {expected}")
    if path.is_dir():
        raise error(f"{path} is a directory; expected {expected}")
    if not os.access(path, os.R_OK):
        raise error(f"{path} cannot be read (permission denied); expected {expected}")
    return path


def read_text(path: Path, expected: str, error: type[Exception] = DataError) -> str:
    """The UTF-8 text of a user's file, or one ``error`` line naming the file and what is wrong with it.

    Undecodable bytes (a binary or differently encoded file passed by
    mistake), a folder or an unreadable file would otherwise surface as a
    codec or OS traceback that does not say which file it was.
    """
    check_readable(path, expected, error)
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise error(
            f"{path} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start}); "
            f"expected {expected}"
        ) from None
    except OSError as e:
        raise error(f"{path} cannot be read ({e.strerror or e}); expected {expected}") from None


def jsonl_records(text: str, path: Path) -> list[tuple[dict[str, Any], str]]:
    """Each line's record of a jsonl text with where it came from, or one error naming the file and line.

    Lines are split at newlines only: ``str.splitlines`` also splits at U+2028, U+0085 and others, which a
    JSON writer may leave raw inside a string (ShareGPT's turns hold them), cutting a record in two."""
    import json

    out = []
    for i, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            out.append((json.loads(line), f"{path}, line {i}"))
        except json.JSONDecodeError as e:
            raise DataError(f"{path}, line {i}: not valid JSON ({e.msg})") from None
    return out
