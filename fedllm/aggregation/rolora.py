"""RoLoRA: alternate which factor the federation trains, so that every round's average is exact.

Chen et al., "Robust Federated Finetuning of LLMs via Alternating Optimization of LoRA" (NeurIPS 2025,
arXiv 2502.01755). FedIT averages A and B separately, and ``mean(B) mean(A) != mean(B A)``. RoLoRA's
rounds alternate: in one every client trains B with A frozen at the global A (the same for all), in the
next A with B frozen at the global B. With the other factor shared, the average of the trained one is the
exact average of the clients' updates (``sum_k p_k s_k B_k A = (sum_k p_k s_k B_k) A``, and likewise for
A), each round uploads one factor (half the adapter at square shapes), and, unlike FFA-LoRA, both factors
learn. The paper's claim: better than FedIT and FFA-LoRA, and more robust as the number of clients grows.

Here: odd rounds train B (round 1 starts from LoRA's init, B = 0, so training A first would get no
gradient), even rounds A. Round 1's A is the run's shared seeded initialization, as FFA-LoRA's. Mixed
ranks: a client of rank ``r_k`` trains the leading ``r_k`` components; its factor enters the average beside
the global's components it did not hold, so the round is the old global plus the weighted mean of the
clients' changes (exact: its frozen factor is the leading part of the shared one). The global factors
persist between rounds, so a server optimizer may step them (``global_state = "parameters"``; it steps the
round's trained factor only); central DP noises the round's trained factor (``linear``).
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
from fedllm.aggregation.ffa import Frozen, frozen_factor
from fedllm.factors import Adapter, LoraFactors, init_factors, pad_with
from fedllm.protocol import ClientHook, ClientUpdate

ROUNDS = "rolora_rounds"  # rounds aggregated so far (the phase when no context says the round)


def trains(round_idx: int) -> str:
    """The factor RoLoRA's clients train in round ``round_idx``: B in odd rounds, A in even ones."""
    return "B" if round_idx % 2 else "A"


class RoLoRAPhase(ClientHook):
    """RoLoRA's client in one round: trains ``uploads`` (one factor) with the other frozen."""

    init_round: ClassVar[int | None] = 1  # RoLoRA's: the shared A of round 1

    def __init__(self, factor: str) -> None:
        self.factor = factor
        self.other = "A" if factor == "B" else "B"

    @property
    def uploads(self) -> tuple[str, ...]:  # type: ignore[override]
        return (self.factor,)

    @property
    def frozen(self) -> tuple[str, ...]:  # type: ignore[override]
        return (self.other,)

    def session(
        self, model: Any, adapter: str, state: dict[str, Tensor], extras: dict[str, Tensor], view: str
    ) -> Frozen | None:
        return Frozen(model, adapter, self.other) if view == "train" else None


class RoLoRAClient(ClientHook):
    """Which factor a client trains and sends depends on the round (:meth:`for_round`)."""

    alternates: ClassVar[bool] = True
    init_round: ClassVar[int | None] = 1  # the shared A of round 1, the same on every client and the server

    def for_round(self, round_idx: int | None) -> ClientHook:
        if round_idx is None:
            return self
        return RoLoRAPhase(trains(round_idx))  # its init_round is RoLoRA's, a class variable


class RoLoRA(Strategy):
    """Average the round's trained factor on the shared frozen one (module docstring)."""

    name = "rolora"
    hook = RoLoRAClient
    linear = True  # the round's new factor is the weighted sum of the uploaded ones

    def initial_factors(self, modules: dict[str, tuple[int, int]], rank: int, seed: int) -> Adapter:
        return init_factors(modules, rank, 1.0, seed)

    def aggregate_factors(
        self,
        updates: list[ClientUpdate],
        weights: list[float],
        state: GlobalState,
        context: RoundContext | None = None,
    ) -> RoundResult:
        round_idx = context.round if context is not None else int(state.extras.get(ROUNDS, 0)) + 1
        factor = trains(round_idx)
        out: Adapter = {}
        for key, g in state.factors.items():
            folded = [self.at_rank(u.factors[key].folded(), g.folded()) for u in updates]
            if factor == "B":
                A = frozen_factor(g, updates, key, "A")
                out[key] = LoraFactors(A, self.average([f.B for f in folded], weights), 1.0)
            else:
                B = frozen_factor(g, updates, key, "B")
                out[key] = LoraFactors(self.average([f.A for f in folded], weights), B, 1.0)
        extras = dict(state.extras)
        extras[ROUNDS] = int(extras.get(ROUNDS, 0)) + 1
        return RoundResult(GlobalState(out, dict(state.residual), extras=extras))

    def at_rank(self, upload: LoraFactors, current: LoraFactors) -> LoraFactors:
        """A client's trained factor beside the global's components it did not hold
        (:meth:`Strategy.at_rank`): the round is the old global plus the weighted mean of the changes
        (zero-padded, rank-2 clients of a rank-6 federation zeroed B's columns 2-5)."""
        return pad_with(upload, current)

    def client_factors(self, state: GlobalState, rank: int, scale: float, client_id: int) -> Adapter | None:
        return leading_factors(state, rank, scale)
