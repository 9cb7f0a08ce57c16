"""Server aggregation strategies, one per file, registered by name."""

from fedllm.aggregation import (  # noqa: F401  (registers the strategies)
    fedex,
    fedit,
    fedsa,
    ffa,
    flexlora,
    flora,
    floral,
    florist,
    hetlora,
    local,
)
from fedllm.aggregation.base import (
    STRATEGIES,
    GlobalState,
    RoundContext,
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
    "RoundContext",
    "RoundResult",
    "Strategy",
    "example_weights",
    "strategy_from_config",
]
