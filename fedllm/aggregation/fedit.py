"""FedIT: federated instruction tuning by averaging LoRA factors.

Zhang et al., "Towards Building the Federated GPT: Federated Instruction
Tuning" (ICASSP 2024). A and B are averaged *separately*, so the global
product ``mean(B) @ mean(A)`` differs from ``mean(B @ A)`` (the cross-term
error is part of the method). With heterogeneous ranks every client's
(scale-folded) factors are zero-padded to the largest rank before averaging.
"""

from __future__ import annotations

from fedllm.aggregation.base import (
    GlobalState,
    RoundContext,
    RoundResult,
    Strategy,
    leading_factors,
    module_io,
)
from fedllm.factors import Adapter, LoraFactors, pad_rank
from fedllm.protocol import ClientUpdate


class FedIT(Strategy):
    """Average A and B separately, weighted by example counts.

    Client: loads the leading ``r_k`` rows of A and columns of B of the global
    adapter (re-scaled to its own ``alpha / r_k``) and trains them.
    """

    name = "fedit"
    supports_robust = True
    supports_download_budget = True
    linear = True  # the new A and B are weighted sums of the clients': central DP can noise those sums

    def aggregate_factors(
        self,
        updates: list[ClientUpdate],
        weights: list[float],
        state: GlobalState,
        context: RoundContext | None = None,
    ) -> RoundResult:
        out: Adapter = {}
        for key in updates[0].factors:
            folded = [u.factors[key].folded() for u in updates]
            rmax = max(f.rank for f in folded)
            padded = [pad_rank(f, rmax) for f in folded]
            out[key] = LoraFactors(
                self.average([f.A for f in padded], weights),
                self.average([f.B for f in padded], weights),
                1.0,
            )
        return RoundResult(GlobalState(out, dict(state.residual), extras=dict(state.extras)))

    def client_factors(self, state: GlobalState, rank: int, scale: float, client_id: int) -> Adapter | None:
        if self.budget_mb and state.factors:
            rank = min(rank, budget_rank(state.factors, self.budget_mb))
        return leading_factors(state, rank, scale)


def budget_rank(factors: Adapter, budget_mb: float) -> int:
    """The largest rank whose download of every module fits ``budget_mb`` (float32): FedIT's averaged rows
    are not ordered by energy, so under a budget a client takes the leading rows as a lower rank would."""
    per_rank = sum(4 * module_io(f) for f in factors.values())
    return int(budget_mb * 1e6 // per_rank)
