"""What a run under secure aggregation reports: its section of the summary and its guarantee line, added
to the inner strategy's (a wrapper, as DP's reports its epsilon; the aggregation is the inner strategy's)."""

from __future__ import annotations

from typing import Any

from fedllm.aggregation.base import StrategyWrapper


class SecureReport(StrategyWrapper):
    """``inner`` with secure aggregation's summary (see module docstring)."""

    def __init__(self, inner, summary: dict[str, Any]) -> None:
        super().__init__(inner)
        self.summary = summary

    def run_summary(self, rounds: int) -> dict[str, Any]:
        out = dict(self.inner.run_summary(rounds))
        guarantees = [*out.get("guarantees", []), *self.summary["guarantees"]]
        return {**out, **self.summary, "guarantees": guarantees}
