"""FedSA-LoRA: share A, keep B: selective aggregation for personalized LoRA.

Guo et al., "Selective Aggregation for Low-Rank Adaptation in Federated
Learning" (ICLR 2025, arXiv 2410.01463). The paper finds that A learns what
is general across clients and B what is client-specific, so only A is
uploaded and averaged (``A_bar = sum_k p_k A_k``) while each client keeps its
own B across rounds: its model is ``W + s B_k A_bar``. The upload is A alone
(half the adapter at square shapes); the headline result is the clients'
personalized accuracy (their own B on the global A).

There is no single global model. A global figure (the server's benchmark and
held-out loss, the "global" column of the personalized evaluation) needs some
B: with ``aggregation.fedsa.share_b_every = N`` the sampled clients also upload
their B every N-th round (counted in the ledger) and the global model is the
global A with the mean of those B's (example-weighted, as A); with 0 (the
default, the paper's protocol) nothing but A ever leaves a client and the
global model is the base itself (B = 0), which the README says. The reference
code averages A with FedAvg's example weights and leaves B out of
aggregation entirely; mixed ranks use the zero-padded generalization (each
client the leading ``r_k`` rows of A_bar).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from fedllm.aggregation.base import GlobalState, RoundContext, RoundResult, Strategy
from fedllm.checks import ClientFailure, Expected, as_float32
from fedllm.factors import Adapter, LoraFactors, lora_modules, unprefixed
from fedllm.options import opt
from fedllm.protocol import ClientHook, ClientUpdate, HookSession

B_OWN = "B."  # a client's own B per module, in its state
B_MEAN = "B_mean."  # the mean of the shared B's, downloaded (strategy extras)
B_SHARED = "B_shared."  # a client's B, uploaded on sharing rounds
SHARE = "share_b"  # downloaded flag: upload B this round


@dataclass
class FedSAOptions:
    share_b_every: int = opt(
        0,
        "clients also upload their B every N-th round, and the global model is the global A with their mean "
        "B (0: B never leaves a client, the paper's protocol; the global model is then the base)",
        lambda x: x >= 0,
        "an integer >= 0",
    )


class FedSASession(HookSession):
    """Puts a B into the active adapter: the client's own (training, its personalized model) or the shared
    mean (the global model as this client gets it); reads its B back for its state and, on sharing rounds,
    the upload."""

    def __init__(
        self, model: Any, adapter: str, state: dict[str, Tensor], extras: dict[str, Tensor], view: str
    ) -> None:
        self.modules = lora_modules(model, adapter)
        self.adapter = adapter
        self.share = bool(extras.get(SHARE, torch.tensor(0)).item())
        source = unprefixed(extras, B_MEAN) if view == "global" else unprefixed(state, B_OWN)
        with torch.no_grad():
            for key, module in self.modules.items():
                w = module.lora_B[adapter].weight
                if view == "global":  # the shared mean (scale folded) at this layer's scale and rank
                    if key in source:
                        b = _pad_cols(source[key], w.shape[1])[:, : w.shape[1]] / float(
                            module.scaling[adapter]
                        )
                        w.copy_(b.to(w.device, w.dtype))
                    else:
                        w.zero_()  # nothing shared yet: the global model is the base
                elif key in source:
                    w.copy_(source[key].to(w.device, w.dtype))
                else:
                    w.zero_()  # a client that has not trained yet: LoRA's zero B

    def _b(self) -> dict[str, Tensor]:
        return {
            k: m.lora_B[self.adapter].weight.detach().to("cpu", torch.float32).clone()
            for k, m in self.modules.items()
        }

    def state(self) -> dict[str, Tensor]:
        return {f"{B_OWN}{k}": b for k, b in self._b().items()}

    def upload(self) -> dict[str, Tensor]:
        return {f"{B_SHARED}{k}": b for k, b in self._b().items()} if self.share else {}


class FedSAClient(ClientHook):
    """FedSA-LoRA's client side: trains A (downloaded) and its own B (kept), uploads A only."""

    personalizes = True  # its personalized model is its own B on the global A
    keeps_state = True  # its own B
    uploads: ClassVar[tuple[str, ...]] = ("A",)
    shared_extras: ClassVar[tuple[str, ...]] = (B_SHARED,)  # its B on sharing rounds: clipped with A

    def start_factors(self, download: Adapter | None, fresh: Adapter) -> Adapter:
        """The downloaded A (its empty B completed with the fresh zero B; the session puts the client's own
        B in), or ``fresh``."""
        if not download:
            return fresh
        return {k: LoraFactors(f.A, fresh[k].B, f.scale) for k, f in download.items()}

    def session(
        self, model: Any, adapter: str, state: dict[str, Tensor], extras: dict[str, Tensor], view: str
    ) -> FedSASession:
        return FedSASession(model, adapter, state, extras, view)


class FedSALoRA(Strategy):
    """Average A (weights p_k); B stays on the clients (see module docstring).

    Client (:class:`FedSAClient`): loads the leading ``r_k`` rows of the
    global A and its own B (zero in its first round, as LoRA initializes B),
    trains both, uploads A (and B on sharing rounds).
    """

    name = "fedsa"
    hook = FedSAClient
    averages_parameters = False  # B is never averaged: algorithms that pull every parameter do not apply
    options = FedSAOptions

    @classmethod
    def sums_uploads(cls, cfg: Any) -> bool:
        """Without B sharing the round is the weighted sum of the uploaded A's (secure aggregation can run
        it); with it, the shared B is averaged over that round's sharers only."""
        return bool(cfg.aggregation.fedsa.share_b_every == 0)

    def __init__(self, share_b_every: int = 0) -> None:
        if share_b_every < 0:
            raise ValueError(f"fedsa_share_b_every = {share_b_every}: expected an integer >= 0")
        self.share_b_every = share_b_every

    @classmethod
    def from_options(cls, options: FedSAOptions) -> FedSALoRA:
        return cls(share_b_every=options.share_b_every)

    def _sharing(self, state: GlobalState) -> bool:
        """Whether the next round is a sharing round (rounds counted by the state itself)."""
        done = int(state.extras.get("rounds", 0))
        return bool(self.share_b_every) and (done + 1) % self.share_b_every == 0

    def accept_extras(self, extras: dict[str, Tensor], exp: Expected) -> dict[str, Tensor]:
        shared = unprefixed(extras, B_SHARED)
        if not shared:
            return {}
        asked = exp.asked.get(SHARE)
        if exp.round is not None and not (isinstance(asked, Tensor) and bool(asked.item())):
            raise ClientFailure("it sends a shared B in a round that asked for none")
        if set(shared) != set(exp.modules):
            raise ClientFailure(
                f"its shared B's cover {len(shared)} modules, not the adapter's {len(exp.modules)}"
            )
        return {
            f"{B_SHARED}{k}": as_float32(f"{B_SHARED}{k}", shared[k], (out_f, exp.rank))
            for k, (out_f, _) in exp.modules.items()
        }

    def aggregate_factors(
        self,
        updates: list[ClientUpdate],
        weights: list[float],
        state: GlobalState,
        context: RoundContext | None = None,
    ) -> RoundResult:
        extras: dict[str, Any] = dict(state.extras)
        extras["rounds"] = int(extras.get("rounds", 0)) + 1
        sharers = [(u, w) for u, w in zip(updates, weights, strict=True) if u.extras]
        out: Adapter = {}
        for key in updates[0].factors:
            rmax = max(u.factors[key].A.shape[0] for u in updates)
            A = self.average([_pad_rows(u.factors[key].A, rmax) for u in updates], weights)
            out_f = updates[0].factors[key].B.shape[0]  # B itself did not travel: an empty out x 0 tensor
            if sharers:  # the mean of the shared B's (scale folded), example-weighted among the sharers
                total = sum(w for _, w in sharers)
                B = self.average(
                    [
                        _pad_cols(u.extras[f"{B_SHARED}{key}"] * u.factors[key].scale, rmax)
                        for u, _ in sharers
                    ],
                    [w / total for _, w in sharers],
                )
            elif key in state.factors and state.factors[key].B.shape[1] == rmax:
                B = state.factors[key].B  # the last shared mean (zero when none was ever shared)
            else:
                B = A.new_zeros(out_f, rmax)
            out[key] = LoraFactors(A, B, 1.0)
        extras["shared"] = int(extras.get("shared", 0)) + (1 if sharers else 0)
        return RoundResult(
            GlobalState(out, dict(state.residual), extras=extras), info={"b_sharers": len(sharers)}
        )

    def client_factors(self, state: GlobalState, rank: int, scale: float, client_id: int) -> Adapter | None:
        """The leading ``rank`` rows of the global A and an empty B (the client keeps its own: only A
        travels)."""
        if not state.factors:
            return None
        return {
            k: LoraFactors(_pad_rows(f.A, rank)[:rank], f.B.new_zeros(f.B.shape[0], 0), scale)
            for k, f in state.factors.items()
        }

    def client_extras(self, state: GlobalState, client_id: int) -> dict[str, Tensor]:
        """Whether to upload B this round, and the shared mean B once there is one (the global model's)."""
        out = {SHARE: torch.tensor(1 if self._sharing(state) else 0)}
        if int(state.extras.get("shared", 0)):
            out.update({f"{B_MEAN}{k}": f.B for k, f in state.factors.items()})
        return out


def _pad_rows(A: Tensor, rank: int) -> Tensor:
    return A if A.shape[0] >= rank else torch.cat([A, A.new_zeros(rank - A.shape[0], A.shape[1])])


def _pad_cols(B: Tensor, rank: int) -> Tensor:
    return B if B.shape[1] >= rank else torch.cat([B, B.new_zeros(B.shape[0], rank - B.shape[1])], dim=1)
