"""The communication ledger: parameters and bytes up and down, per client and round.

Counted from the tensors that actually cross the boundary (the factors a
client loads or merges, its upload, extras such as control variates), so a
strategy's cost is measured rather than assumed.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

MIB = 2**20  # FlowerTune's strategy counts its "MB" as bytes / 1024**2
FLOWERTUNE_BUDGET_MIB = 200_000  # the leaderboard's communication limit, in those units


@dataclass
class Ledger:
    """``by_client`` False: totals only, no per-client counts (a secret sample must not be recoverable from
    how often each client uploaded). ``counts`` False: nothing is traffic (local-only, whose round trip is
    the client's own adapter kept for it: a method that needs no communication reports none)."""

    bytes_per_param: int = 4
    by_client: bool = True
    counts: bool = True
    up_params: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    down_params: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    round_up: int = 0
    round_down: int = 0
    up_bytes: int = (
        0  # the encoded bytes of every upload so far (a quantized transport: fewer than 4 a value)
    )
    round_up_bytes: int = 0
    down_bytes: int = 0  # the encoded bytes of every download so far (float32 unless a transport encodes)
    round_down_bytes: int = 0
    round_down_max: int = 0  # the largest download of one client this round, in bytes
    # a catch-up's merges of rounds before the newest, downloaded by clients that missed them (FLoRA,
    # FLoRIST): beyond what aggregation.florist.download_budget_mb bounds, which is one round's merge
    catchup_bytes: int = 0
    round_catchup_bytes: int = 0
    round_down_max_round: int = 0  # the largest download of this round's state alone (what a budget bounds)

    def start_round(self) -> None:
        self.round_up = self.round_down = self.round_up_bytes = self.round_down_max = (
            self.round_down_bytes
        ) = self.round_catchup_bytes = self.round_down_max_round = 0

    def download(self, client: int, params: int, nbytes: int | None = None, catchup_bytes: int = 0) -> None:
        """``nbytes``: what it took on the wire (default: float32, ``bytes_per_param`` a value), of which
        ``catchup_bytes`` were merges of rounds before the newest that the client missed."""
        if not self.counts:
            return
        self.down_params[client if self.by_client else -1] += params
        self.round_down += params
        nbytes = params * self.bytes_per_param if nbytes is None else nbytes
        self.down_bytes += nbytes
        self.round_down_bytes += nbytes
        self.round_down_max = max(self.round_down_max, nbytes)
        self.catchup_bytes += catchup_bytes
        self.round_catchup_bytes += catchup_bytes
        self.round_down_max_round = max(self.round_down_max_round, nbytes - catchup_bytes)

    def upload(self, client: int, params: int, nbytes: int | None = None) -> None:
        """``nbytes``: what it took on the wire (default: float32, ``bytes_per_param`` a value)."""
        if not self.counts:
            return
        self.up_params[client if self.by_client else -1] += params
        self.round_up += params
        nbytes = params * self.bytes_per_param if nbytes is None else nbytes
        self.up_bytes += nbytes
        self.round_up_bytes += nbytes

    def round_summary(self) -> dict[str, Any]:
        return {
            "up_params": self.round_up,
            "down_params": self.round_down,
            "up_bytes": self.round_up_bytes,
            "down_bytes": self.round_down_bytes,
            "down_bytes_max": self.round_down_max,  # the largest download of one client
            # ... without merges of earlier rounds it had missed: what a download budget bounds
            "down_bytes_max_round": self.round_down_max_round,
            "down_catchup_bytes": self.round_catchup_bytes,  # those earlier merges, over the round's clients
        }

    def totals(self) -> dict[str, Any]:
        up, down = sum(self.up_params.values()), sum(self.down_params.values())
        return {
            "total_up_params": up,
            "total_down_params": down,
            "total_up_bytes": self.up_bytes,
            "total_down_bytes": self.down_bytes,
            "total_down_catchup_bytes": self.catchup_bytes,
            **(
                {
                    "per_client": {
                        str(c): {
                            "up_params": self.up_params.get(c, 0),
                            "down_params": self.down_params.get(c, 0),
                        }
                        for c in sorted(set(self.up_params) | set(self.down_params))
                    }
                }
                if self.by_client
                else {}
            ),
        }

    def state(self) -> dict[str, Any]:
        return {
            "up": dict(self.up_params),
            "down": dict(self.down_params),
            "bytes_per_param": self.bytes_per_param,
            "by_client": self.by_client,
            "up_bytes": self.up_bytes,
            "down_bytes": self.down_bytes,
            "catchup_bytes": self.catchup_bytes,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Ledger:
        led = cls(bytes_per_param=state.get("bytes_per_param", 4), by_client=state.get("by_client", True))
        led.up_params.update({int(k): v for k, v in state["up"].items()})
        led.down_params.update({int(k): v for k, v in state["down"].items()})
        # (a checkpoint from before bytes were counted: its uploads travelled in float32)
        led.up_bytes = state.get("up_bytes", sum(led.up_params.values()) * led.bytes_per_param)
        led.down_bytes = state.get("down_bytes", sum(led.down_params.values()) * led.bytes_per_param)
        led.catchup_bytes = state.get("catchup_bytes", 0)
        return led
