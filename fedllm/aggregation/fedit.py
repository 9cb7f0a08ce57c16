"""FedIT: federated instruction tuning by averaging LoRA factors.

Zhang et al., "Towards Building the Federated GPT: Federated Instruction
Tuning" (ICASSP 2024). A and B are averaged *separately*, so the global
product ``mean(B) @ mean(A)`` differs from ``mean(B @ A)`` (the cross-term
error is part of the method). With heterogeneous ranks every client's
(scale-folded) factors are zero-padded to the largest rank before averaging.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from fedllm.aggregation.base import (
    GlobalState,
    RoundContext,
    RoundResult,
    Strategy,
    leading_factors,
    module_io,
)
from fedllm.factors import Adapter, LoraFactors, pad_rank, weighted_mean
from fedllm.options import nonneg, one_of, opt
from fedllm.protocol import ClientUpdate


@dataclass
class FedITOptions:
    robust: str = opt(
        "none",
        "a robust aggregate instead of the weighted mean: the coordinate-wise median or trimmed mean of the "
        "clients' tensors (the weights are then ignored)",
        *one_of("none", "median", "trimmed_mean"),
    )
    trim_fraction: float = opt(
        0.1,
        "with robust=trimmed_mean: the share of clients dropped at each end of every coordinate",
        lambda x: 0 <= x < 0.5,
        "in [0, 0.5)",
    )
    download_budget_mb: float = opt(
        0.0,
        "megabytes (10^6 bytes, float32) of the adapter each client may download per round: the largest rank "
        "that fits (FedIT's averaged rows are not ordered by energy; 0: no budget)",
        nonneg,
        ">= 0",
    )


class FedIT(Strategy):
    """Average A and B separately, weighted by example counts.

    Client: loads the leading ``r_k`` rows of A and columns of B of the global
    adapter (re-scaled to its own ``alpha / r_k``) and trains them.
    """

    name = "fedit"
    linear = True  # the new A and B are weighted sums of the clients': central DP can noise those sums
    options = FedITOptions

    def __init__(
        self, robust: str = "none", trim_fraction: float = 0.1, download_budget_mb: float = 0.0
    ) -> None:
        if robust not in ("none", "median", "trimmed_mean"):
            raise ValueError(f"robust = {robust!r}: expected none, median or trimmed_mean")
        if not 0 <= trim_fraction < 0.5:
            raise ValueError(f"trim_fraction = {trim_fraction} is invalid: expected a value in [0, 0.5)")
        self.robust, self.trim_fraction, self.budget_mb = robust, trim_fraction, download_budget_mb

    @classmethod
    def from_options(cls, options: FedITOptions) -> FedIT:
        return cls(options.robust, options.trim_fraction, options.download_budget_mb)

    def average(self, tensors: list[Tensor], weights: list[float]) -> Tensor:
        """The weighted mean, or with ``robust`` the coordinate-wise median or trimmed mean.

        The robust rules ignore the weights (a client's share is then 1/K):
        each coordinate takes the median, or the mean after dropping the
        ``trim_fraction`` largest and smallest values, so a few clients
        sending extreme values cannot move it. Cost: a sort over the K
        clients per coordinate (memory K x the tensor).
        """
        if self.robust == "none":
            return weighted_mean(tensors, weights)
        stacked = torch.stack(tensors)
        if self.robust == "median":
            return stacked.median(dim=0).values
        k = int(self.trim_fraction * len(tensors))
        return stacked.sort(dim=0).values[k : len(tensors) - k].mean(dim=0)

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
