"""What each client's base misses of the updates merged into it (FLoRA, FLoRIST), in bounded memory.

A merging strategy changes the base every round; a client that was not
sampled for a while has an old base. It downloads one exact catch-up: the
merges after the round its base is at, added into their smallest exact form
(``fedllm.factors.add_to_residual``: the size of the missed rank, or the
dense matrix when that is smaller), never the backlog one by one. The server
keeps only the newest ``window`` merges for that; a client further behind (or
one whose state the server does not know, after a failure) downloads the
whole merged residual and restarts from its original base. Memory is bounded
by the window and the residual's own bound, not by rounds or clients.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from fedllm.factors import Adapter, adapter_from_tensors, adapter_numel, adapter_tensors, add_to_residual
from fedllm.protocol import Catchup

UNKNOWN = -1  # the server does not know which merges a client's base has (it failed mid-round)


class MergeLog:
    """The newest merges, where each client's base is, and the catch-up each one downloads."""

    def __init__(self, clients: list[int], window: int = 8) -> None:
        self.window = window
        self.recent: list[tuple[int, Adapter]] = []  # (round, merged update), oldest first
        self.evicted = 0  # the newest round whose merge left ``recent`` (0: none)
        self.at = {k: 0 for k in clients}  # the merge round each client's base is at
        self._cache: dict[int, Catchup] = {}  # this round's catch-ups, by the round a base is at

    @property
    def last(self) -> int:
        """The newest round whose update was merged (0: none)."""
        return self.recent[-1][0] if self.recent else self.evicted

    def catchup(self, client_id: int, residual: Adapter) -> Catchup | None:
        """What ``client_id``'s base misses (None when it has everything); ``residual``: all merged so far."""
        at, last = self.at[client_id], self.last
        if at >= last:
            return None
        if at not in self._cache:
            if at >= self.evicted:  # every merge after ``at`` is still kept
                update: Adapter = {}
                for r, merged in self.recent:
                    if r > at:
                        update = add_to_residual(update, merged)
                self._cache[at] = Catchup(at, last, update)
            else:
                self._cache[at] = Catchup(0, last, residual)
        return self._cache[at]

    def behind_newest(self, catchup: Catchup | None) -> int:
        """Parameters of ``catchup`` beyond the newest merge: what a client that missed earlier merges
        downloads on top of what one whose base had all but the newest does (0 for that one)."""
        if catchup is None or not self.recent:
            return 0
        before_newest = self.recent[-2][0] if len(self.recent) > 1 else self.evicted
        if catchup.from_round >= before_newest:
            return 0
        return max(0, adapter_numel(catchup.update) - adapter_numel(self.recent[-1][1]))

    def add(self, round_idx: int, merged: Adapter) -> None:
        """A round's merged update (nothing when it merged none)."""
        if merged:
            self.recent.append((round_idx, merged))
            self._cache = {}
        while len(self.recent) > self.window:
            self.evicted = self.recent.pop(0)[0]

    def replied(self, client_id: int, catchup: Catchup | None) -> None:
        """A client that replied applied its catch-up before training."""
        if catchup is not None:
            self.at[client_id] = catchup.to_round

    def failed(self, client_id: int) -> None:
        """A client that failed may or may not have applied its catch-up: the next one is the whole
        residual.
        """
        self.at[client_id] = UNKNOWN

    def state_dict(self) -> tuple[dict[str, Tensor], dict[str, float], dict[str, Any]]:
        tensors, scales = {}, {}
        for r, m in self.recent:
            t, s = adapter_tensors(m, f"merge.{r}.")
            tensors.update(t)
            scales.update(s)
        meta = {
            "merge_rounds": [r for r, _ in self.recent],
            "evicted": self.evicted,
            "synced": {str(k): v for k, v in self.at.items()},
        }
        return tensors, scales, meta

    def load_state_dict(self, tensors: dict[str, Tensor], meta: dict[str, Any]) -> None:
        self.recent = [
            (r, adapter_from_tensors(tensors, meta["scales"], f"merge.{r}.")) for r in meta["merge_rounds"]
        ]
        self.evicted = meta.get("evicted", 0)
        self.at.update({int(k): v for k, v in meta.get("synced", {}).items()})
        self._cache = {}
