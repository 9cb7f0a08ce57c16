"""FedEx-LoRA: exact aggregation by merging FedIT's cross-term error into the base.

Singhal et al., "Exact Aggregation for Federated and Efficient Fine-Tuning of
Foundation Models" (ACL 2025, arXiv 2410.09432). Clients download the averaged
factors ``B_bar = sum_k p_k B_k`` and ``A_bar = sum_k p_k A_k`` as in FedIT; the
error of that average,

    residual = sum_k p_k B_k A_k - B_bar A_bar,

is merged into the base, so base + residual + B_bar A_bar is exactly the
weighted average of the clients' models. The same p_k weight both terms
(the paper's Eq. 5; an implementation that weights the first sum by example
counts but subtracts the unweighted ``mean(B) @ mean(A)`` is not exact when
clients differ in size). The residual is kept as factors (the stacked client
factors beside ``-B_bar``, rank at most sum r_k + r, reduced to its numerical
rank), never as a dense d x d matrix on the server.

The paper uses one rank for every client. With mixed ranks this is the
zero-padded generalization (as FedIT: every client's factors padded to the
largest rank); the aggregate is still exact, but a client of lower rank
starts from the leading components of the global factors (the remainder
stays in the global model it is evaluated on, not in its own start).
"""

from __future__ import annotations

from dataclasses import dataclass

from fedllm.aggregation.base import (
    GlobalState,
    MergingOptions,
    MergingStrategy,
    RoundContext,
    RoundResult,
    leading_factors,
)
from fedllm.factors import Adapter, LoraFactors, add_to_residual, concat, pad_rank, smallest_exact, stack
from fedllm.protocol import ClientUpdate


@dataclass
class FedExOptions(MergingOptions):
    """FedEx-LoRA's options: the merges kept for catch-ups."""


class FedExLoRA(MergingStrategy):
    """Average A and B (weights p_k), merge the exact remainder into the base.

    Client: merges the downloaded residual into its base, loads the leading
    ``r_k`` components of the averaged factors and trains them.
    """

    name = "fedex"
    # it merges the remainder (under a quantized base it stays a frozen residual adapter)
    options = FedExOptions

    def aggregate_factors(
        self,
        updates: list[ClientUpdate],
        weights: list[float],
        state: GlobalState,
        context: RoundContext | None = None,
    ) -> RoundResult:
        factors: Adapter = {}
        merged: Adapter = {}
        for key in updates[0].factors:
            folded = [u.factors[key].folded() for u in updates]
            rmax = max(f.rank for f in folded)
            padded = [pad_rank(f, rmax) for f in folded]
            a_bar = self.average([f.A for f in padded], weights)
            b_bar = self.average([f.B for f in padded], weights)
            factors[key] = LoraFactors(a_bar, b_bar, 1.0)
            exact = stack(folded, weights)  # sum_k p_k B_k A_k
            remainder = concat({key: exact}, {key: LoraFactors(a_bar, -b_bar, 1.0)})[key]
            # a DenseDelta where that is smaller: a merged residual may hold one (factors.Adapter)
            merged[key] = smallest_exact(remainder)  # type: ignore[assignment]
        return RoundResult(
            GlobalState(factors, add_to_residual(state.residual, merged), extras=dict(state.extras)), merged
        )

    def client_factors(self, state: GlobalState, rank: int, scale: float, client_id: int) -> Adapter | None:
        return leading_factors(state, rank, scale)
