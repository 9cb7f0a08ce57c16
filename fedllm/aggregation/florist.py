"""FLoRIST: singular value thresholding of the stacked update.

Ramesh et al., "FLoRIST: Singular Value Thresholding for Efficient and
Accurate Federated Fine-Tuning of Large Language Models" (2025). Like FlexLoRA
the server takes the SVD of ``sum_k p_k s_k B_k A_k`` from the stacked factors
(no dense matrix), then keeps only the top ``p`` singular values that hold a
fraction ``tau`` of the energy (``sum s_i^2``); ``tau = 0.9`` is the paper's
robust default. One rank-``p`` global adapter is broadcast and merged into the
base, so the download grows with ``p`` instead of the sum of ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fedllm.aggregation.base import GlobalState, MergingOptions, MergingStrategy, RoundContext, RoundResult
from fedllm.factors import (
    Adapter,
    add_to_residual,
    energy_rank,
    low_rank_svd,
    ranks_under_budget,
    stack,
    svd_factors,
)
from fedllm.options import fraction, nonneg, opt
from fedllm.protocol import ClientUpdate


@dataclass
class FloristOptions(MergingOptions):
    tau: float = opt(0.9, "energy fraction of singular values kept", fraction, "in (0, 1]")
    fixed_rank: int = opt(
        0,
        "keep exactly this rank instead of using tau (0: use tau)",
        nonneg,
        "an integer >= 1, or 0 to use tau",
    )
    download_budget_mb: float = opt(
        0.0,
        "megabytes (10^6 bytes, float32) of the adapter each client may download per round: the largest "
        "energy share up to tau whose broadcast fits (0: no budget). It bounds one round's merge: a client "
        "that missed rounds also downloads their merges (its catch-up), counted apart as down_catchup_bytes",
        nonneg,
        ">= 0",
    )


class FLoRIST(MergingStrategy):
    """Threshold the singular values by energy (or keep a fixed rank) and merge.

    Client: merges the broadcast rank-``p`` update into its base weights and
    trains a fresh LoRA of its own rank.
    """

    name = "florist"
    averages_parameters = False
    options = FloristOptions

    def __init__(
        self, tau: float = 0.9, fixed_rank: int = 0, download_budget_mb: float = 0.0, catchup_window: int = 8
    ) -> None:
        if not 0 < tau <= 1:
            raise ValueError(f"tau = {tau} is invalid: expected a value in (0, 1]")
        if fixed_rank < 0:
            raise ValueError(f"fixed_rank = {fixed_rank} is invalid: expected >= 1 (or 0 to use tau)")
        super().__init__(catchup_window)
        self.tau, self.fixed_rank, self.budget_mb = tau, fixed_rank, download_budget_mb

    @classmethod
    def check_config(cls, cfg: Any) -> None:
        if cfg.aggregation.florist.fixed_rank and cfg.aggregation.florist.download_budget_mb:
            raise ValueError(
                "aggregation.florist.fixed_rank and aggregation.florist.download_budget_mb both choose the "
                "rank: set one of them"
            )

    @classmethod
    def from_options(cls, options: FloristOptions) -> FLoRIST:
        return cls(options.tau, options.fixed_rank, options.download_budget_mb, options.catchup_window)

    def budget_ranks(self, spectra: dict[str, tuple[torch.Tensor, int]]) -> tuple[dict[str, int], float]:
        """Each module's rank under ``download_budget_mb`` and the energy share chosen (one
        share for every module, the largest up to ``tau`` that fits: ``fedllm.factors.ranks_under_budget``);
        a budget below one component per module leaves the round's merge empty."""
        return ranks_under_budget(spectra, self.budget_mb * 1e6, self.tau)

    def aggregate_factors(
        self,
        updates: list[ClientUpdate],
        weights: list[float],
        state: GlobalState,
        context: RoundContext | None = None,
    ) -> RoundResult:
        merged: Adapter = {}
        kept: dict[str, int] = {}
        svds = {
            key: low_rank_svd(stack([u.factors[key] for u in updates], weights)) for key in updates[0].factors
        }
        info: dict[str, Any] = {}
        if self.budget_mb:
            chosen, share = self.budget_ranks(
                {k: (s, u.shape[0] + vh.shape[1]) for k, (u, s, vh) in svds.items()}
            )
            info["budget_energy_share"] = share
        for key, (u, s, vh) in svds.items():
            if self.budget_mb:
                p = chosen[key]
            else:
                p = min(self.fixed_rank, s.numel()) if self.fixed_rank else energy_rank(s, self.tau)
            merged[key] = svd_factors(u, s, vh, p)
            kept[key] = p
        ranks = [
            max((f.A.shape[0] for f in u.factors.values() if hasattr(f, "A")), default=0) for u in updates
        ]
        info.update(
            {
                "kept_rank_mean": sum(kept.values()) / len(kept),
                "kept_rank_max": max(kept.values()),
                # the paper's claim is about these: the rank kept per layer against the clients' ranks
                "kept_rank": kept,
                "client_rank_max": max(ranks),
                "client_rank_sum": sum(ranks),
            }
        )
        return RoundResult(
            GlobalState({}, add_to_residual(state.residual, merged), extras=dict(state.extras)), merged, info
        )
