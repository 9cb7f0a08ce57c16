"""Server aggregation strategies, one per file, registered by name."""

from fedllm.aggregation import (  # noqa: F401  (registers the strategies)
    fedex,
    fedit,
    fedsa,
    fedsb,
    fedsvd,
    ffa,
    flexlora,
    flora,
    floral,
    florist,
    hetlora,
    local,
    rolora,
    server_opt,
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
from fedllm.aggregation.server_opt import SERVER_OPTIMIZERS, with_server_opt
from fedllm.protocol import ClientUpdate

__all__ = [
    "SERVER_OPTIMIZERS",
    "STRATEGIES",
    "ClientUpdate",
    "GlobalState",
    "RoundContext",
    "RoundResult",
    "Strategy",
    "example_weights",
    "strategy_from_config",
    "with_server_opt",
]
