"""Rouge-L of generated answers against their references (Natural Instructions' metric for held-out tasks).

Scored with Google's ``rouge-score`` (the implementation Natural Instructions and FedKSeed report with):
the F-measure of the longest common subsequence of words, Porter-stemmed, the best over an example's
references, in percent. Imports nothing from fedllm.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

# rouge-score logs "Using default tokenizer." at INFO for every scorer it builds
logging.getLogger("absl").setLevel(logging.WARNING)


def rouge_l(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> list[float]:
    """Each prediction's Rouge-L F-measure (0-100) against the best of its references."""
    from rouge_score import rouge_scorer

    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions for {len(references)} reference lists")
    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
    out = []
    for pred, refs in zip(predictions, references, strict=True):
        if not refs:
            raise ValueError("every prediction needs at least one reference")
        out.append(100.0 * max(scorer.score(ref, pred)["rougeL"].fmeasure for ref in refs))
    return out
