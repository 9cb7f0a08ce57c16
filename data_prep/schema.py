"""The one instruction schema every loader maps into.

Dolly, Alpaca and Wizard name their fields differently; the rest of the
pipeline only ever sees :class:`Example`, so prompt building and partitioning
are written once.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


class DataError(ValueError):
    """Bad input data: the message names the file, line/row and field."""


@dataclass(frozen=True)
class Example:
    """One instruction-following example.

    ``category`` drives non-IID partitioning; datasets without categories get
    ``None`` and the partitioner falls back as documented in ``partition.py``.
    """

    instruction: str
    input: str
    response: str
    category: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)
