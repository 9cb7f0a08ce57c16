"""MMLU subjects and their categories (as tagged in lm-evaluation-harness)."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

CATEGORIES = ("stem", "humanities", "social_sciences", "other")


@cache
def mmlu_subjects() -> dict[str, str]:
    """``{subject: category}`` for the 57 MMLU subjects."""
    data = json.loads((Path(__file__).parent / "mmlu_subjects.json").read_text())
    return {s: v["category"] for s, v in data["subjects"].items()}


def category_of(subject: str, extra: dict[str, str] | None = None) -> str:
    """The category of ``subject``; unknown subjects (e.g. built-in ones) via ``extra`` or 'other'."""
    if extra and subject in extra:
        return extra[subject]
    return mmlu_subjects().get(subject, "other")
