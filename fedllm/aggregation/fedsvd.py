"""FedSVD: FFA-LoRA's frozen A, re-oriented by the server's SVD every round.

Lee et al., "FedSVD: Adaptive Orthogonalization for Private Federated Learning with LoRA" (NeurIPS 2025,
code: seanie12/fed-svd). Clients train B with A fixed, as in FFA-LoRA, so the average of their B's is the
exact average of their updates, ``sum_k p_k s_k B_k A = (sum_k p_k s_k B_k) A``, and a noised sum of B's
is all central DP needs. FFA-LoRA's A stays the random initialization forever, which limits what B can
express; FedSVD's server instead takes the SVD of the aggregated product, ``B_bar A = U S V^T``, and
broadcasts ``A = V^T`` (orthonormal rows: the top right singular vectors) and ``B = U S``. The product, the
global model, is unchanged by the re-factoring; the next round's clients train B against an A aligned with
what the federation has learned. Under DP the SVD is post-processing of the noised B (:meth:`release` runs
after the wrapper's noise), so it costs no privacy.

Here: the SVD from a QR of the factors and an ``r x r`` core (never the dense matrix, as FlexLoRA's).
Round 1's A is the shared seeded initialization (a client derives it from the run's seed, as FFA-LoRA's,
and downloads B alone); from round 2 on a client downloads its leading ``r_k`` rows of A and columns of B
(counted). Heterogeneous ranks: the singular directions are ordered by energy, so a client of rank ``r_k``
trains B against the ``r_k`` most energetic directions; its ``B_k`` enters the average beside the global B's
columns it did not hold (its change, zero beyond its rank, is what is averaged), so the round is the old
product plus the weighted mean of the clients' changes, exactly, at any mix of ranks. Clients
upload B only. The global factors are re-made every round, so a server optimizer or a client algorithm that
keeps state per parameter is refused (``global_state = "refactored"``).
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
from fedllm.factors import Adapter, LoraFactors, init_factors, low_rank_svd, pad_rank, pad_with, svd_factors
from fedllm.protocol import ClientHook, ClientUpdate

ROUNDS = "fedsvd_rounds"  # rounds re-factored so far (0: A is still the seed's, never sent)


class FedSVDClient(ClientHook):
    """Trains B on the A it downloaded (round 1: the seed's shared A, derived locally); uploads B only."""

    uploads: ClassVar[tuple[str, ...]] = ("B",)
    frozen: ClassVar[tuple[str, ...]] = ("A",)
    init_round: ClassVar[int | None] = 1  # the shared init every client derives: round 1's

    def start_factors(self, download: Adapter | None, fresh: Adapter) -> Adapter:
        """The downloaded A and B; a download whose A is empty (round 1) takes the seed's shared A."""
        if not download:
            return fresh
        out = {}
        for k, f in download.items():
            A = fresh[k].A if f.A.shape[0] == 0 else f.A
            out[k] = LoraFactors(A, f.B, f.scale)
        return super().start_factors(out, fresh)

    def session(
        self, model: Any, adapter: str, state: dict[str, Tensor], extras: dict[str, Tensor], view: str
    ) -> Frozen | None:
        return Frozen(model, adapter) if view == "train" else None


class FedSVD(Strategy):
    """Average B on the common A (exact), then re-factor the product by SVD: A = V^T, B = U S."""

    name = "fedsvd"
    hook = FedSVDClient
    linear = True  # combine() is a weighted sum of the uploaded B's; the SVD is release()
    global_state = "refactored"
    averages_parameters = False  # A changes every round: per-parameter client state would refer to nothing

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
            A = frozen_factor(g, updates, key, "A")
            B = self.average([self.at_rank(u.factors[key].folded(), g.folded()).B for u in updates], weights)
            out[key] = LoraFactors(A, B, 1.0)
        extras = dict(state.extras)
        extras[ROUNDS] = int(extras.get(ROUNDS, 0)) + 1
        return RoundResult(GlobalState(out, dict(state.residual), extras=extras))

    def at_rank(self, upload: LoraFactors, current: LoraFactors) -> LoraFactors:
        """A client's B beside the global B's columns it did not hold (:meth:`Strategy.at_rank`): the round
        is the old product plus the weighted mean of the clients' changes, so a client that changed nothing
        moves nothing, whatever its rank (zero-padded, a rank-2 client of ranks 6/4/2 moved the product by
        13 %)."""
        return pad_with(upload, current)

    def release(self, state: GlobalState) -> GlobalState:
        """``B A = U S V^T`` re-factored as ``A = V^T``, ``B = U S`` at the same rank (the same product)."""
        factors = {}
        for key, f in state.factors.items():
            u, s, vh = low_rank_svd(f)
            g = svd_factors(u, s, vh, s.numel(), "us")
            if g.rank < f.rank:  # more components than the module's side: the rest carry nothing
                g = pad_rank(g, f.rank)
                g.A[s.numel() :] = f.A[s.numel() :]
            factors[key] = g
        return GlobalState(factors, state.residual, state.dense, state.extras)

    def client_factors(self, state: GlobalState, rank: int, scale: float, client_id: int) -> Adapter | None:
        """The leading ``rank`` components at the client's scale; before the first re-factoring, B alone (the
        client derives the seed's A)."""
        lead = leading_factors(state, rank, scale)
        if lead and not int(state.extras.get(ROUNDS, 0)):
            return {k: LoraFactors(f.A[:0], f.B, f.scale) for k, f in lead.items()}
        return lead
