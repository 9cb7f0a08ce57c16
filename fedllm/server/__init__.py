"""The server: the round's sampling, downloads, the checks on what clients send, aggregation, the ledger.

``server.py`` is the :class:`Server` itself; ``trust.py`` what it may believe of an update;
``catchup.py`` what a returning client's base misses; ``ledger.py`` the communication it counts. It
holds no model (no peft, transformers or accelerate). The names below load lazily, so that a strategy
can import ``fedllm.server.trust`` without importing the server (which imports the strategies).
"""

from __future__ import annotations

from typing import Any

_EXPORTS = ("RoundPlan", "RoundReport", "Rules", "Sampling", "Server", "global_state")

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        from fedllm.server import server

        return getattr(server, name)
    raise AttributeError(f"module 'fedllm.server' has no attribute {name!r}")
