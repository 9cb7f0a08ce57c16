"""FlexLoRA: heterogeneous ranks through an SVD of the aggregated update.

Bai et al., "Federated Fine-tuning of Large Language Models under
Heterogeneous Tasks and Client Resources" (NeurIPS 2024). The server forms
``W = sum_k p_k s_k B_k A_k`` and gives each client the rank-``r_k`` truncated
SVD of it. Here ``W`` is never formed: the SVD comes from a QR of the stacked
factors and an SVD of a small R x R core (R = sum of ranks), which is exact.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedllm.aggregation.base import (
    GlobalState,
    RoundContext,
    RoundResult,
    Strategy,
    leading_factors,
    module_io,
)
from fedllm.factors import (
    Adapter,
    low_rank_svd,
    ranks_under_budget,
    singular_values,
    stack,
    svd_factors,
    truncate_rank,
)
from fedllm.options import nonneg, one_of, opt
from fedllm.protocol import ClientUpdate


@dataclass
class FlexLoRAOptions:
    split: str = opt(
        "us",
        "how a client's truncated SVD U S V^T is split into its factors: 'us' (B = U S, A = V^T, as the "
        "reference) or 'sqrt' (B = U sqrt(S), A = sqrt(S) V^T)",
        *one_of("us", "sqrt"),
    )
    download_budget_mb: float = opt(
        0.0,
        "megabytes (10^6 bytes, float32) of the adapter each client may download per round: the largest "
        "share of the global SVD that fits, at most the client's rank (0: no budget)",
        nonneg,
        ">= 0",
    )


class FlexLoRA(Strategy):
    """Global update = exact weighted sum, kept in SVD form (singular values sorted).

    Client: loads the leading ``r_k`` SVD components (its truncated SVD,
    re-scaled to its own scale), split as ``B = U S``, ``A = Vh`` as in the
    reference implementation (FederatedScope's FlexLoRA branch), or
    ``B = U sqrt(S)``, ``A = sqrt(S) Vh`` (``split="sqrt"``). The product is the
    same, the training that follows is not: the split sets the factors' scales.
    """

    name = "flexlora"
    global_state = "refactored"  # the SVD of the averaged product, anew every round
    averages_parameters = False
    options = FlexLoRAOptions

    def __init__(self, split: str = "us", download_budget_mb: float = 0.0) -> None:
        if split not in ("us", "sqrt"):
            raise ValueError(f"split = {split!r}: expected 'us' or 'sqrt'")
        self.split, self.budget_mb = split, download_budget_mb

    @classmethod
    def from_options(cls, options: FlexLoRAOptions) -> FlexLoRA:
        return cls(options.split, options.download_budget_mb)

    def aggregate_factors(
        self,
        updates: list[ClientUpdate],
        weights: list[float],
        state: GlobalState,
        context: RoundContext | None = None,
    ) -> RoundResult:
        out: Adapter = {}
        for key in updates[0].factors:
            stacked = stack([u.factors[key] for u in updates], weights)
            u, s, vh = low_rank_svd(stacked)
            out[key] = svd_factors(u, s, vh, s.numel(), self.split)
        return RoundResult(GlobalState(out, dict(state.residual), extras=dict(state.extras)))

    def client_factors(self, state: GlobalState, rank: int, scale: float, client_id: int) -> Adapter | None:
        if not (self.budget_mb and state.factors):
            return leading_factors(state, rank, scale)
        # under a budget: the largest energy share of the global SVD whose leading components, at most the
        # client's rank per module, fit (one share for every module, as FLoRIST's budget)
        spectra = {k: (singular_values(f), module_io(f)) for k, f in state.factors.items()}
        ranks, _ = ranks_under_budget(spectra, self.budget_mb * 1e6, 1.0, cap=rank)
        return {k: truncate_rank(f, ranks[k]).with_scale(scale) for k, f in state.factors.items()}
