"""Client local-training algorithms, one per file, registered by name."""

from fedllm.client import fedprox, perfedavg, scaffold, sft  # noqa: F401  (registers the algorithms)
from fedllm.client.base import ALGORITHMS, ClientAlgorithm, LocalResult, LocalWork

__all__ = ["ALGORITHMS", "ClientAlgorithm", "LocalResult", "LocalWork"]
