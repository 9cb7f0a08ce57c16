"""Each simulated client's local state on disk, in memory only while the client takes part in a round.

A client's state (SCAFFOLD's control variate, FLoRAL's router, a pending
correction) is as large as its adapter; with 1,000 clients it cannot all stay
in RAM or be rewritten into every checkpoint. Here it lives in
``<run>/clients/client-<id>-r<round>.safetensors``: one version per round the
client trained, written atomically by the process that trained it, read back
by whichever process trains it next. A checkpoint records only the index
(client -> the round of its current version), so writing one costs nothing
for the clients that did not train since the previous one; resuming reads
the index of the checkpoint it resumes from, so versions written after that
checkpoint are never read. Versions no kept checkpoint refers to are
deleted. A client without state has no file.

Memory is O(clients of the round); checkpoint time O(clients of the round).
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

from safetensors.torch import load_file

from fedllm.files import CheckpointError, io_cause, round_checkpoints, save_tensors_atomic
from fedllm.logs import names_clients

log = logging.getLogger(__name__)

_FILE = re.compile(r"client-(\d+)-r(\d+)\.safetensors")


class ClientStore:
    """Client state by (client, round) on disk, and the index of each client's current version."""

    def __init__(self, root: Path, writes: bool = True) -> None:
        self.root = Path(root)
        self.writes = writes  # False on processes that train no client alone (data layout, non-main)
        self.index: dict[int, int] = {}  # client -> the round of its current state version

    def path(self, client_id: int, round_idx: int) -> Path:
        return self.root / f"client-{client_id}-r{round_idx}.safetensors"

    def load(self, client) -> None:
        """Give ``client`` its current state (empty when it has none yet)."""
        r = self.index.get(client.client_id)
        if r is None:
            client.state = {}
            return
        path = self.path(client.client_id, r)
        try:
            client.state = load_file(str(path))
        except Exception as e:  # OSError, or safetensors' own error type for a damaged file
            raise RuntimeError(
                f"the state of client {client.client_id} ({path}) cannot be read: {e}; resume from an "
                "earlier checkpoint or start a new run"
            ) from e

    def save(self, client, round_idx: int) -> bool:
        """Write ``client``'s state as its version of ``round_idx`` (nothing when it has none); returns
        whether it has state. Every process calls :meth:`trained` with the answer so all indexes agree."""
        if not client.state:
            return False
        if not names_clients():  # the config refuses state under a secret sample; this file would name it
            raise RuntimeError(
                "a client's state would be written to the run folder under a secret sample, which names who "
                "took part in the round: the method that keeps it must declare keeps_state (or its feature "
                "client_state) so that the config refuses the combination"
            )
        if self.writes:
            path = self.path(client.client_id, round_idx)
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                save_tensors_atomic(path, client.state)
            except Exception as e:  # OSError, or safetensors' own error type for the same failures
                raise CheckpointError(
                    f"could not write the state of client {client.client_id} to {path}: {io_cause(e)}"
                ) from e
        return True

    def trained(self, client_id: int, round_idx: int, has_state: bool) -> None:
        if has_state:
            self.index[client_id] = round_idx
        else:
            self.index.pop(client_id, None)

    @staticmethod
    def release(client) -> None:
        """Drop ``client``'s state from memory (it is on disk)."""
        client.state = {}

    # ------------------------------------------------------------ checkpoints
    def meta(self) -> dict[str, Any]:
        return {"client_state": {str(k): r for k, r in sorted(self.index.items())}}

    def restore(self, meta: dict[str, Any]) -> None:
        """The index of the checkpoint being resumed; refuses one whose files are gone."""
        self.index = {int(k): int(r) for k, r in meta.get("client_state", {}).items()}
        missing = [self.path(k, r) for k, r in self.index.items() if not self.path(k, r).exists()]
        if missing:
            raise RuntimeError(
                f"{len(missing)} client state file(s) this checkpoint refers to are missing, e.g. "
                f"{missing[0]}: the run folder was changed; start a new run"
            )

    def prune(self, run_dir: Path) -> int:
        """Delete the versions that neither this index nor a kept checkpoint refers to; returns how many."""
        if not self.writes or not self.root.exists():
            return 0
        keep = {(k, r) for k, r in self.index.items()}
        for ckpt in round_checkpoints(run_dir):
            try:
                meta = json.loads((ckpt / "meta.json").read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue  # a damaged checkpoint is never resumed from
            keep |= {(int(k), int(r)) for k, r in meta.get("client_state", {}).items()}
        removed = 0
        for path in self.root.glob("client-*-r*.safetensors"):
            m = _FILE.fullmatch(path.name)
            if m and (int(m.group(1)), int(m.group(2))) not in keep:
                path.unlink(missing_ok=True)
                removed += 1
        return removed
