"""HetLoRA: zero-padded aggregation of heterogeneous ranks, weighted by each update's norm.

Cho et al., "Heterogeneous LoRA for Federated Fine-tuning of On-Device
Foundation Models" (EMNLP 2024, arXiv 2401.06432). Every client trains the
leading ``r_k`` components of one global adapter of the largest rank; the
server zero-pads the clients' factors to that rank and averages them with
*sparsity-weighted* shares: client k's share of a module is
``||s_k B_k A_k||_F / sum_j ||s_j B_j A_j||_F`` (the Frobenius norm of its
update to that module), so a client whose low rank, or whose own pruning,
left it a small update pulls the global adapter less than one that learned a
large one. The paper publishes no code; this follows its Section 3 and
weights per module. The weights come from the updates themselves, so they
are computed after the server's norm clipping (``aggregation.clip_norm_ratio``)
has bounded every update: a client cannot buy a larger share with a larger
update than the clip allows.

The paper's optional local rank self-pruning (a client shrinks its rank when
the norm of its last components falls) is not implemented: every client keeps
its configured rank.
"""

from __future__ import annotations

import torch

from fedllm.aggregation.base import ClientUpdate, GlobalState, RoundResult, Strategy, leading_factors
from fedllm.factors import Adapter, LoraFactors
from fedllm.lowrank import low_rank_svd, pad_rank


def update_norm(f: LoraFactors) -> float:
    """``||scale * B @ A||_F`` from the factors (the singular values of the small core, no dense matrix)."""
    _, s, _ = low_rank_svd(f)
    return float(torch.linalg.vector_norm(s.double()))


class HetLoRA(Strategy):
    """Zero-pad to the largest rank and average with norm-proportional shares.

    Client: loads the leading ``r_k`` components of the global adapter (at
    its own scale) and trains them.
    """

    name = "hetlora"
    same_weights = False  # each module has its own shares (SCAFFOLD's one weight per client does not hold)

    def aggregate_factors(
        self, updates: list[ClientUpdate], weights: list[float], state: GlobalState
    ) -> RoundResult:
        out: Adapter = {}
        shares: dict[str, list[float]] = {}
        for key in updates[0].factors:
            folded = [u.factors[key].folded() for u in updates]
            norms = [update_norm(f) for f in folded]
            total = sum(norms)
            p = [n / total for n in norms] if total > 0 else list(weights)
            rmax = max(f.rank for f in folded)
            padded = [pad_rank(f, rmax) for f in folded]
            out[key] = LoraFactors(
                self.average([f.A for f in padded], p), self.average([f.B for f in padded], p), 1.0
            )
            shares[key] = p
        info = {"norm_share_max": max(max(p) for p in shares.values())} if shares else {}
        return RoundResult(GlobalState(out, dict(state.residual), extras=dict(state.extras)), info=info)

    def client_factors(self, state: GlobalState, rank: int, scale: float, client_id: int) -> Adapter | None:
        return leading_factors(state, rank, scale)
