"""What crosses the federated boundary, and what both halves derive alike.

The server (``fedllm/server.py``) and the client runtime
(``fedllm/client/runtime.py``) share nothing but this module and the
``LoraFactors`` type: a round is ``server.plan_round`` -> one
:class:`ClientStart` per client -> (a driver moves it: a function call, a
gather under accelerate, a Flower message) -> ``runtime.train`` -> one
:class:`ClientUpdate` -> ``server.finish_round``. Seeds are derived from
integers (:func:`derive_seed`), so both halves, on any process or site, draw
the same numbers without sharing a generator.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor

from fedllm.factors import Adapter, adapter_from_tensors, adapter_numel, adapter_tensors


def derive_seed(*parts: int) -> int:
    """A stable 63-bit seed from integers (independent of process layout)."""
    h = 1469598103934665603
    for p in parts:
        h = ((h ^ (p & 0xFFFFFFFFFFFF)) * 1099511628211) % (1 << 63)
    return h


def _numel(tensors: dict[str, Tensor]) -> int:
    return sum(t.numel() for t in tensors.values())


@dataclass
class ClientStart:
    """What a client downloads for a round.

    ``factors``: the adapter to load (None: a fresh LoRA); ``merges``: updates
    to merge into its base that it has not applied yet, oldest first (FLoRA,
    FLoRIST); ``dense``: the fully trained modules; ``extras``: strategy state
    a client trains from (FLoRAL's bias adaptors); ``algo``: the client
    algorithm's server state (SCAFFOLD's control variate).
    """

    round: int
    factors: Adapter | None = None
    merges: list[tuple[int, Adapter]] = field(default_factory=list)  # (round, update), oldest first
    dense: dict[str, Tensor] = field(default_factory=dict)
    extras: dict[str, Tensor] = field(default_factory=dict)
    algo: dict[str, Tensor] = field(default_factory=dict)

    def numel(self) -> int:
        """Parameters this download carries (the communication ledger counts these)."""
        return (
            (adapter_numel(self.factors) if self.factors else 0)
            + sum(adapter_numel(m) for _, m in self.merges)
            + _numel(self.dense)
            + _numel(self.extras)
            + _numel(self.algo)
        )


@dataclass
class ClientUpdate:
    """What one client uploads: its adapter, example count and extras.

    ``extras`` holds algorithm- or strategy-specific tensors that travel with
    the update (SCAFFOLD's control-variate delta, FLoRAL's router
    probabilities and bias adaptors); they are counted in the ledger. ``start``
    is the adapter the client began from after its fresh initialization (what
    norm clipping measures the change from); the server could derive it from
    the round's seed, so it is not counted as traffic.
    """

    client_id: int
    num_examples: int
    factors: Adapter
    dense: dict[str, Tensor] = field(default_factory=dict)
    extras: dict[str, Tensor] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    start: Adapter = field(default_factory=dict)

    def numel(self) -> int:
        return adapter_numel(self.factors) + _numel(self.dense) + _numel(self.extras)


@dataclass
class ClientInfo:
    """What the server knows of a client: its id, LoRA rank and scale, and how many examples it trains on."""

    client_id: int
    rank: int
    scale: float
    num_examples: int


class AlgorithmServer:
    """The server half of a client algorithm: what clients download besides the adapter, and its update.

    The default (plain SFT, FedProx, Per-FedAvg) has no server state.
    SCAFFOLD's half keeps the control variate (``fedllm/client/scaffold.py``).
    """

    @classmethod
    def from_config(cls, client_cfg) -> AlgorithmServer:
        return cls()

    def download(self, rank: int) -> dict[str, Tensor]:
        """What a client whose adapter has rank ``rank`` downloads for this algorithm."""
        return {}

    def update(self, updates: list[ClientUpdate], population_examples: int) -> None:
        """After a round's aggregation; ``population_examples`` counts the examples of all clients."""

    def state_dict(self) -> dict[str, Tensor]:
        return {}

    def load_state_dict(self, tensors: dict[str, Tensor]) -> None:
        """Restore what :meth:`state_dict` returned (resume)."""


# ---- messages as flat tensors + JSON metadata (Flower's ArrayRecord / ConfigRecord, or any transport) ----


def _flat(prefix: str, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    return {f"{prefix}{k}": v.detach().contiguous() for k, v in tensors.items()}


def _part(tensors: dict[str, Tensor], prefix: str) -> dict[str, Tensor]:
    return {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}


def encode_start(start: ClientStart) -> tuple[dict[str, Tensor], dict]:
    tensors, scales = adapter_tensors(start.factors or {}, "factors.")
    for r, m in start.merges:
        t, s = adapter_tensors(m, f"merge.{r}.")
        tensors.update(t)
        scales.update(s)
    for prefix, part in (("dense.", start.dense), ("extras.", start.extras), ("algo.", start.algo)):
        tensors.update(_flat(prefix, part))
    return tensors, {
        "round": start.round,
        "scales": scales,
        "has_factors": start.factors is not None,
        "merge_rounds": [r for r, _ in start.merges],
    }


def decode_start(tensors: dict[str, Tensor], meta: dict) -> ClientStart:
    scales = meta["scales"]
    return ClientStart(
        meta["round"],
        adapter_from_tensors(tensors, scales, "factors.") if meta["has_factors"] else None,
        [(r, adapter_from_tensors(tensors, scales, f"merge.{r}.")) for r in meta["merge_rounds"]],
        _part(tensors, "dense."),
        _part(tensors, "extras."),
        _part(tensors, "algo."),
    )


def encode_update(update: ClientUpdate) -> tuple[dict[str, Tensor], dict]:
    tensors, scales = adapter_tensors(update.factors, "factors.")
    t, s = adapter_tensors(update.start, "start.")
    tensors.update(t)
    scales.update(s)
    tensors.update(_flat("dense.", update.dense))
    tensors.update(_flat("extras.", update.extras))
    return tensors, {
        "client_id": update.client_id,
        "num_examples": update.num_examples,
        "scales": scales,
        "metrics": update.metrics,
    }


def decode_update(tensors: dict[str, Tensor], meta: dict) -> ClientUpdate:
    scales = meta["scales"]
    return ClientUpdate(
        meta["client_id"],
        meta["num_examples"],
        adapter_from_tensors(tensors, scales, "factors."),
        _part(tensors, "dense."),
        _part(tensors, "extras."),
        dict(meta["metrics"]),
        adapter_from_tensors(tensors, scales, "start."),
    )
