"""One round, one config, one start: the statement every site of a secure round signs before it masks.

SecAgg+ hides each site's update in the sum of the round's updates; it says nothing of what each site was
asked to train. A server that sends the target site the run's config and start and every other site a round
that changes nothing (``client.lr=1e-30``, a start of B = 0, A = 1e-30, no noise under distributed DP) gets a
sum that is the target's update alone: the model-inconsistency attack on secure aggregation (Pasquini,
Francati, Ateniese, "Eluding Secure Aggregation in Federated Learning via Model Inconsistency", CCS 2022).
Their defence: make every site's participation depend on all sites holding the same model. fedllm's sites do
that with the keys they already hold (``fedllm/secagg/binding.py``):

* **The statement.** After the keys are shared and before the collect stage, fedllm's ServerApp sends every
  site its start (the FitIns it will train from) and the round's **full-rank global state** (the factors at
  the federation's largest rank, the dense modules, the strategy's state). Each site checks, by the rule
  the server itself uses (``fedllm.flower.site.expected_start``: the strategy's cut of the global state to
  the site's rank and scale, the run's download encoding; the site composes it, as it reads the config
  this package never imports), that its start is its part of that state (:func:`check_start`); then it
  signs, with its registered node key, the statement :func:`statement`: the run, the federation, the round
  and its plan token, a digest of the whole config (every field: the server sends all sites one config),
  of the round's layout and of the full-rank state. A site signs one statement per round of its
  federation, ever: it records the statement on its disk before it signs, so that a server that restarts
  the protocol (or the run) holds no second statement of that round from it to relay to others
  (``fedllm.secagg.flower.pledge_statement``).
* **The check.** The collect message carries every site's statement signature. A site masks and sends its
  vector only when **every** neighbour of the round (with ``secagg.num_shares=1``: every site of the round)
  signed, with the key the federation's registry holds for it, the very statement the site signed, and the
  start in the collect message is the one it checked. So no masked vector, and no unmask share, leaves a site
  before it knows that every vector the sum can hold was trained under one config from one start.
* **Why every site, not a threshold.** The sum the server unmasks is over the round's survivors. If a
  threshold of agreeing signatures sufficed, a server could give the target one statement and the others
  (a threshold of them) another: the others would find enough signatures on theirs, answer the unmask,
  and the sum would hold the target's update beside theirs that change nothing. Requiring every neighbour
  before the masked vector leaves puts every survivor under one statement. The price: a site that drops
  between the key sharing and the collect stage fails the round (fedllm's sites already fail a round that
  loses a site before the collect stage: they mask with every neighbour or with none).

Sites without the federation's registry (the Simulation Engine, a plain deployment) sign nothing and check
nothing here: they keep only the single-message checks (docs/trust.md).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch
from torch import Tensor

import fedllm.secagg.binding as binding
from fedllm.aggregation.base import GlobalState
from fedllm.protocol import ClientStart
from fedllm.secagg.guard import Refused

# fedllm's stage between share-keys and collect, the round's full-rank state in it, a site's signature in its
# reply, and every site's in the collect message (named in binding, which the guard reads too)
STAGE, GLOBAL, SIGNATURE = binding.STATEMENT, binding.GLOBAL, binding.STATEMENT_SIGNATURE
SIGNERS, SIGNATURES = binding.STATEMENT_SIGNERS, binding.STATEMENT_SIGNATURES

_STATEMENT = b"fedllm-secagg-statement-v1\0"


def encode_state(state: GlobalState) -> bytes:
    """The round's global state as the bytes a site receives (safetensors, the checkpoint's layout)."""
    from safetensors.torch import save

    from fedllm.server.server import state_tensors

    tensors, meta = state_tensors(state)
    return bytes(save({k: t.contiguous() for k, t in tensors.items()}, {"meta": json.dumps(meta)}))


def decode_state(data: bytes) -> tuple[GlobalState, bytes]:
    """The global state of :func:`encode_state`'s bytes, and its digest (:func:`state_digest`); a clear
    refusal for bytes that are not one."""
    from safetensors.torch import load

    from fedllm.server.server import global_state

    try:
        tensors = load(data)
        meta = json.loads(_header_meta(data))
        state = global_state(tensors, meta)
    except Exception as e:  # whatever a server put there
        raise Refused(f"the round's global state is unreadable ({type(e).__name__}: {e})") from None
    return state, state_digest(tensors, meta)


def _header_meta(data: bytes) -> str:
    """The ``meta`` entry of a safetensors file's header (its JSON metadata)."""
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    return str(header["__metadata__"]["meta"])


def tensors_digest(tensors: dict[str, Tensor]) -> hashlib._Hash:
    """A SHA-256 over every tensor by name: its name, dtype, shape and raw bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(json.dumps([name, str(t.dtype), list(t.shape)]).encode() + b"\0")
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h


def state_digest(tensors: dict[str, Tensor], meta: dict[str, Any]) -> bytes:
    """The digest of a global state's tensors and metadata (canonical: name order, JSON with sorted keys)."""
    h = tensors_digest(tensors)
    h.update(json.dumps(meta, sort_keys=True).encode())
    return h.digest()


def statement(
    run_id: int, federation: str, round_idx: int, token: str, cfg_digest: bytes, layout: str, state: bytes
) -> bytes:
    """What every site of a round signs: the same bytes at every site exactly when they were all sent one
    round of one run of one federation, one config, one layout and one full-rank start."""
    layout_digest = hashlib.sha256(layout.encode()).digest()
    parts = (run_id, federation, round_idx, token, cfg_digest, layout_digest, state)
    return hashlib.sha256(_STATEMENT + binding._framed(*parts)).digest()


def fitins_digest(config: Any) -> bytes:
    """The digest of what a collect message's FitIns carries (the start record and the layout)."""
    start, layout = bytes(config[binding.START]), str(config[binding.LAYOUT])
    return hashlib.sha256(start + b"\0" + layout.encode()).digest()


def check_start(got: ClientStart, want: ClientStart, state: GlobalState) -> None:
    """``got`` (the start a site was sent) is ``want`` (its part of the round's global state), tensor for
    tensor, bit for bit; nothing else rides along (a merge to apply, an algorithm's server state: the
    strategies and algorithms that run on a sum have none)."""
    if state.residual or got.catchup is not None:
        raise Refused("a merged update in a secure round: the strategies that run on a sum merge nothing")
    if got.algo:
        raise Refused("an algorithm's server state in a secure round: those that run on a sum keep none")
    if got.round != want.round:
        raise Refused(f"a start of round {got.round} in the statement of round {want.round}")
    mine, theirs = _start_tensors(got), _start_tensors(want)
    differ = sorted(k for k in set(mine) | set(theirs) if not _same(mine.get(k), theirs.get(k)))
    if differ:
        raise Refused(
            f"the start this site was sent is not its part of the round's global start ({len(differ)} "
            f"tensor(s) differ, e.g. {differ[0]}): another site may have been sent another model"
        )


def _same(a: Tensor | None, b: Tensor | None) -> bool:
    return a is not None and b is not None and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def _start_tensors(start: ClientStart) -> dict[str, Tensor]:
    """A start's tensors by name (factors with their scales as tensors, dense modules, extras)."""
    out: dict[str, Tensor] = {}
    for key, f in (start.factors or {}).items():
        for part in ("A", "B", "D"):
            t = getattr(f, part, None)
            if t is not None:
                out[f"factors.{key}.{part}"] = t
        out[f"factors.{key}.scale"] = torch.tensor(float(f.scale), dtype=torch.float64)
    out.update({f"dense.{k}": t for k, t in start.dense.items()})
    out.update({f"extras.{k}": t for k, t in start.extras.items() if isinstance(t, Tensor)})
    return out


def federation_of(node_config: Any, registry_path: str | None) -> str:
    """The federation a site belongs to: its operator's ``--node-config federation=ID``, else the digest of
    the registry file it holds (the federation's registry names its members); empty where it has neither
    (an unbound site)."""
    from pathlib import Path

    from fedllm.flower.node import node_setting

    named = node_setting(node_config, "federation")
    if named is not None:
        return f"id:{named}"
    if registry_path:
        return "registry:" + hashlib.sha256(Path(registry_path).read_bytes()).hexdigest()[:32]
    return ""
