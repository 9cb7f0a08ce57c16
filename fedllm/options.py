"""The field helper every options section uses: a default with its help text and its valid range."""

from __future__ import annotations

import typing
from dataclasses import field
from typing import Any


def opt(default: Any, help: str, check: typing.Callable[[Any], bool] | None = None, expect: str = "") -> Any:
    """A config field with help text and an optional range check."""
    meta = {"help": help, "check": check, "expect": expect}
    if isinstance(default, list | dict):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)


def _positive(x: Any) -> bool:
    return x > 0


def _fraction(x: Any) -> bool:
    return 0 < x <= 1


def _nonneg(x: Any) -> bool:
    return x >= 0
