"""FFA-LoRA: A frozen at one shared, seeded initialization; only B is trained, sent and averaged.

Sun, Qin, Li and Zhang, "Improving LoRA in Privacy-preserving Federated
Learning" (ICLR 2024, arXiv 2403.12313). With A fixed and the same for every
client, ``sum_k p_k s_k B_k A = (sum_k p_k s_k B_k) A``: averaging B alone is
the exact average of the clients' updates (FedIT's separate averages of A and
B are not), the upload is B alone, and the aggregate is a plain sum of the
clients' B changes, which is what central differential privacy needs
(``privacy.mode=central``; the noise then never touches A).

The global A is the rank-``r_max`` initialization of round 1's seed (peft's
Kaiming-uniform, as every fedllm client initializes; B starts at zero), set
by the server before round 1 and never changed. It never travels: a client
derives the leading ``r_k`` rows of it from the run's seed (ranks share
their leading rows, ``init_factors``), downloads B alone and trains B
against them (heterogeneous ranks: the
zero-padded generalization, each client's B padded to ``r_max`` columns).
The paper's choice of a larger alpha for the frozen A is left to
``lora.alpha_ratio``.
"""

from __future__ import annotations

from typing import Any, ClassVar

from torch import Tensor

from fedllm.aggregation.base import (
    GlobalState,
    RoundContext,
    RoundResult,
    Strategy,
    leading_factors,
)
from fedllm.factors import Adapter, LoraFactors, init_factors, lora_modules, pad_rank
from fedllm.protocol import ClientHook, ClientUpdate, HookSession


class Frozen(HookSession):
    """Factors of a client's adapter made untrainable for one session, restored after: A here and in FedSVD,
    B in RoLoRA's A rounds (``factors`` "A" or "B"), both in Fed-SB ("AB"), whose sessions also keep the
    forward hooks they add in :attr:`handles` (removed on close)."""

    def __init__(self, model: Any, adapter: str, factors: str = "A") -> None:
        self.modules = lora_modules(model, adapter)
        self.weights = [
            getattr(m, f"lora_{f}")[adapter].weight for m in self.modules.values() for f in factors
        ]
        self.trainable = [w.requires_grad for w in self.weights]
        for w in self.weights:
            w.requires_grad_(False)
        self.handles: list[Any] = []

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
        for w, t in zip(self.weights, self.trainable, strict=True):
            w.requires_grad_(t)


def frozen_factor(g: LoraFactors, updates: list[ClientUpdate], key: str, factor: str) -> Tensor:
    """The frozen ``factor`` ("A" or "B") of module ``key`` every client of a round trained against (the
    server's reference of each update: the leading components of one shared factor): the widest update's,
    and the global ``g``'s components beyond it (no client of the largest rank this round). FedSVD's A,
    RoLoRA's A or B."""
    widest = max((u.factors[key].folded() for u in updates), key=lambda f: f.rank)
    if factor == "A":
        A = g.A.clone()
        A[: widest.rank] = widest.A
        return A
    B = g.B.clone()
    B[:, : widest.rank] = widest.B
    return B


class FFAClient(ClientHook):
    """Trains B on the frozen A, which it derives from the run's seed (its download carries B alone, A as
    an empty ``0 x in``); uploads B only."""

    uploads: ClassVar[tuple[str, ...]] = ("B",)
    frozen: ClassVar[tuple[str, ...]] = ("A",)
    init_round: ClassVar[int | None] = 1  # "fresh" is always round 1's init: the leading rows of the frozen A

    def start_factors(self, download: Adapter | None, fresh: Adapter) -> Adapter:
        """The downloaded B on the seed-derived frozen A (``fresh``'s A), or ``fresh``."""
        if not download:
            return fresh
        return {k: LoraFactors(fresh[k].A, f.B, f.scale) for k, f in download.items()}

    def session(
        self, model: Any, adapter: str, state: dict[str, Tensor], extras: dict[str, Tensor], view: str
    ) -> Frozen | None:
        return Frozen(model, adapter) if view == "train" else None


class FFALoRA(Strategy):
    """Average B (weights p_k, zero-padded to r_max); A is the frozen global one (module docstring)."""

    name = "ffa"
    hook = FFAClient
    linear = True  # the new B is the weighted sum of the clients' B: central DP can noise that sum

    def initial_factors(self, modules: dict[str, tuple[int, int]], rank: int, seed: int) -> Adapter:
        return init_factors(modules, rank, 1.0, seed)

    def aggregate_factors(
        self,
        updates: list[ClientUpdate],
        weights: list[float],
        state: GlobalState,
        context: RoundContext | None = None,
    ) -> RoundResult:
        out: Adapter = {}
        for key, g in state.factors.items():
            padded = [pad_rank(u.factors[key].folded(), g.rank).B for u in updates]
            out[key] = LoraFactors(g.A, self.average(padded, weights), 1.0)
        return RoundResult(GlobalState(out, dict(state.residual), extras=dict(state.extras)))

    def client_factors(self, state: GlobalState, rank: int, scale: float, client_id: int) -> Adapter | None:
        """The leading ``rank`` columns of the global B at the client's scale, and an empty A: the client
        derives the frozen A from the seed, so A is never sent."""
        lead = leading_factors(state, rank, scale)
        return {k: LoraFactors(f.A[:0], f.B, f.scale) for k, f in lead.items()} if lead else None
