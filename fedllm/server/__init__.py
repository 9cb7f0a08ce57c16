"""The server: the round's sampling, downloads, the checks on what clients send, aggregation, the ledger.

``server.py`` is the :class:`Server` itself; ``trust.py`` what it may believe of an update (with the checks
it shares with the strategies and algorithms, ``fedllm/checks.py``); ``catchup.py`` what a returning
client's base misses; ``ledger.py`` the communication it counts. It holds no model (no peft, transformers
or accelerate).
"""

from fedllm.server.server import RoundPlan, RoundReport, Sampling, Server, ServerPolicy, global_state

__all__ = ["RoundPlan", "RoundReport", "Sampling", "Server", "ServerPolicy", "global_state"]
