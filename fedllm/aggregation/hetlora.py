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
update than the clip allows, and the server's cap on one client's share
(``federation.max_client_weight``) applies to them as to example weights.

Local rank self-pruning (the paper's Section 3.2, ``aggregation.hetlora.prune_gamma``
= gamma > 0): each client adds ``lambda * ||s B_tail A_tail||_F`` per module to
its local objective, where the tail is its components ``floor(gamma r')..r'``
of its current rank ``r'`` (``aggregation.hetlora.prune_lambda``). When the
tail's norm after local training is smaller than it was after the client's
previous round, the client prunes it: ``r' <- max(1, floor(gamma r'))`` for
its later rounds (kept in its state; components beyond ``r'`` are zero in
what it trains and sends). The paper publishes no code, so two choices are
ours and stated: the norm compared is the whole tail's over all modules, and
the regularizer's gradient is added per backward pass (with
``client.grad_accum`` > 1 it counts that many times). A pruned client still
sends its zero components at its configured rank, and the ledger counts
them: the protocol has one rank per client. The server reports the clients'
mean effective rank (``agg_effective_rank_mean`` in ``metrics.jsonl``: components with a non-zero A
row, counted from the updates themselves).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from fedllm.aggregation.base import (
    GlobalState,
    RoundContext,
    RoundResult,
    Strategy,
    leading_factors,
)
from fedllm.checks import cap_weights
from fedllm.factors import Adapter, LoraFactors, lora_modules, low_rank_svd, pad_rank
from fedllm.options import nonneg, opt
from fedllm.protocol import ClientHook, ClientUpdate, HookSession


@dataclass
class HetLoRAOptions:
    prune_gamma: float = opt(
        0.0,
        "local rank self-pruning's decay factor gamma (a client whose last components' norm fell keeps "
        "floor(gamma r) of them; 0: off, every client keeps its rank)",
        lambda x: x == 0 or 0 < x < 1,
        "0 (off) or in (0, 1)",
    )
    prune_lambda: float = opt(
        0.01, "weight of the norm penalty on the components self-pruning may drop", nonneg, ">= 0"
    )


RANK, TAIL = "rank", "tail_norm"  # a pruning client's state: its current rank, its tail's norm last round


def update_norm(f: LoraFactors) -> float:
    """``||scale * B @ A||_F`` from the factors (the singular values of the small core, no dense matrix)."""
    _, s, _ = low_rank_svd(f)
    return float(torch.linalg.vector_norm(s.double()))


def tail_start(rank: int, gamma: float) -> int:
    """Where the tail ``floor(gamma r)..r`` of a rank-``r`` adapter starts (at least one component)."""
    return min(max(0, math.floor(gamma * rank)), rank - 1)


def effective_rank(adapter: Adapter) -> int:
    """The components in use: the highest index of a non-zero A row, over all modules, plus one."""
    top = 0
    for f in adapter.values():
        rows = torch.nonzero(torch.linalg.vector_norm(f.A, dim=1) > 0)
        if len(rows):
            top = max(top, int(rows.max().item()) + 1)
    return top


class PruningSession(HookSession):
    """One client's self-pruning while it trains: components beyond its rank ``r'`` masked out of the
    forward pass (zero in what it sends), the tail regularizer's gradient added to its factors'."""

    def __init__(
        self, model: Any, adapter: str, state: dict[str, Tensor], gamma: float, lam: float, train: bool
    ) -> None:
        self.modules = lora_modules(model, adapter)
        self.adapter = adapter
        self.gamma, self.lam = gamma, lam
        full = next(iter(self.modules.values())).lora_A[adapter].weight.shape[0] if self.modules else 0
        self.rank = int(state[RANK].item()) if RANK in state else full
        self.last_tail = float(state[TAIL].item()) if TAIL in state else None  # first round: none
        self.handles: list[Any] = []
        self.train = train
        if not self.modules or (self.rank >= full and not train):
            return
        if train:
            self._zero_beyond()
        for m in self.modules.values():
            a, b = m.lora_A[adapter], m.lora_B[adapter]
            mask = (torch.arange(a.weight.shape[0], device=a.weight.device) < self.rank).to(a.weight.dtype)
            self.handles.append(a.register_forward_hook(lambda _m, _i, out, mask=mask: out * mask))
            if train and self.lam > 0:
                scale = float(m.scaling[adapter])
                self.handles.append(
                    a.weight.register_hook(lambda g, a=a, b=b, s=scale: g + self._grad(a, b, s, "A"))
                )
                self.handles.append(
                    b.weight.register_hook(lambda g, a=a, b=b, s=scale: g + self._grad(a, b, s, "B"))
                )

    def _zero_beyond(self) -> None:
        with torch.no_grad():
            for m in self.modules.values():
                m.lora_A[self.adapter].weight[self.rank :].zero_()
                m.lora_B[self.adapter].weight[:, self.rank :].zero_()

    def _grad(self, a: Any, b: Any, s: float, factor: str) -> Tensor:
        """d/dA (``factor`` "A") or d/dB of ``lambda * ||s B_t A_t||_F`` (zero where the tail is zero: a
        subgradient). Each parameter's hook computes its own factor's gradient only."""
        lo, hi = tail_start(self.rank, self.gamma), self.rank
        g = torch.zeros_like(a.weight if factor == "A" else b.weight)
        with torch.no_grad():
            at, bt = a.weight[lo:hi], b.weight[:, lo:hi]
            m = s * (bt @ at)
            norm = torch.linalg.matrix_norm(m)
            if norm > 0:
                if factor == "A":
                    g[lo:hi] = self.lam * s * (bt.T @ m) / norm
                else:
                    g[:, lo:hi] = self.lam * s * (m @ at.T) / norm
        return g

    def _tail_norm(self, rank: int) -> float:
        """``||s B_t A_t||_F`` over all modules for the tail of a rank-``rank`` adapter."""
        lo = tail_start(rank, self.gamma)
        total = 0.0
        with torch.no_grad():
            for m in self.modules.values():
                a, b = m.lora_A[self.adapter].weight[lo:rank], m.lora_B[self.adapter].weight[:, lo:rank]
                total += float(torch.linalg.matrix_norm(float(m.scaling[self.adapter]) * (b @ a))) ** 2
        return math.sqrt(total)

    def state(self) -> dict[str, Tensor]:
        """The rank from now on: the tail pruned at once when its norm fell below last round's."""
        tail = self._tail_norm(self.rank)
        if self.last_tail is not None and tail < self.last_tail and self.rank > 1:
            self.rank = max(1, math.floor(self.gamma * self.rank))  # close() zeroes the pruned tail
            tail = self._tail_norm(self.rank)  # the new tail, compared after the next round
        return {RANK: torch.tensor(self.rank), TAIL: torch.tensor(tail)}

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        if self.train and self.modules:
            self._zero_beyond()  # what leaves the client is exactly its rank-r' adapter


class HetLoRAClient(ClientHook):
    """HetLoRA's client side with self-pruning on: see :class:`PruningSession`."""

    keeps_state = True  # its pruned rank and last tail norm

    def __init__(self, gamma: float, lam: float) -> None:
        self.gamma, self.lam = gamma, lam

    def session(
        self, model: Any, adapter: str, state: dict[str, Tensor], extras: dict[str, Tensor], view: str
    ) -> PruningSession | None:
        if view != "train" and RANK not in state:
            return None  # never pruned: its model is its plain adapter
        return PruningSession(model, adapter, state, self.gamma, self.lam, train=view == "train")


class HetLoRA(Strategy):
    """Zero-pad to the largest rank and average with norm-proportional shares.

    Client: loads the leading ``r_k`` components of the global adapter (at
    its own scale) and trains them.
    """

    name = "hetlora"
    same_weights = False  # each module has its own shares (SCAFFOLD's one weight per client does not hold)
    options = HetLoRAOptions

    def __init__(self, prune_gamma: float = 0.0, prune_lambda: float = 0.0) -> None:
        if not 0.0 <= prune_gamma < 1.0:
            raise ValueError(
                f"aggregation.hetlora.prune_gamma = {prune_gamma}: expected 0 (off) or in (0, 1)"
            )
        self.prune_gamma, self.prune_lambda = prune_gamma, prune_lambda

    @classmethod
    def from_options(cls, options: HetLoRAOptions) -> HetLoRA:
        return cls(prune_gamma=options.prune_gamma, prune_lambda=options.prune_lambda)

    def client_hook(self) -> ClientHook:
        if self.prune_gamma > 0:
            return HetLoRAClient(self.prune_gamma, self.prune_lambda)
        return ClientHook()

    def aggregate_factors(
        self,
        updates: list[ClientUpdate],
        weights: list[float],
        state: GlobalState,
        context: RoundContext | None = None,
    ) -> RoundResult:
        out: Adapter = {}
        shares: dict[str, list[float]] = {}
        for key in updates[0].factors:
            folded = [u.factors[key].folded() for u in updates]
            norms = [update_norm(f) for f in folded]
            total = sum(norms)
            p = [n / total for n in norms] if total > 0 else list(weights)
            if context is not None:  # the server's cap on one client's share holds for norm shares too
                p = cap_weights(p, context.max_weight)
            rmax = max(f.rank for f in folded)
            padded = [pad_rank(f, rmax) for f in folded]
            out[key] = LoraFactors(
                self.average([f.A for f in padded], p), self.average([f.B for f in padded], p), 1.0
            )
            shares[key] = p
        info = {"norm_share_max": max(max(p) for p in shares.values())} if shares else {}
        if shares:
            info["effective_rank_mean"] = sum(effective_rank(u.factors) for u in updates) / len(updates)
        return RoundResult(GlobalState(out, dict(state.residual), extras=dict(state.extras)), info=info)

    def client_factors(self, state: GlobalState, rank: int, scale: float, client_id: int) -> Adapter | None:
        return leading_factors(state, rank, scale)
