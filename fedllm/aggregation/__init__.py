"""Server aggregation strategies, one per file, registered by name."""

from fedllm.aggregation import fedit, flexlora, flora, floral, florist, local  # noqa: F401  (registers the strategies)
from fedllm.aggregation.base import (
    STRATEGIES,
    GlobalState,
    RoundResult,
    Strategy,
    example_weights,
    strategy_from_config,
)
from fedllm.protocol import ClientUpdate

__all__ = [
    "STRATEGIES",
    "ClientUpdate",
    "GlobalState",
    "RoundResult",
    "Strategy",
    "example_weights",
    "strategy_from_config",
]
