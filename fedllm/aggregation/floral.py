"""FLoRAL: federated mixtures of LoRA adaptors with client-specific routers.

Almansoori et al., "Collaborative and Efficient Personalization with Mixtures
of Adaptors" (FLoRAL). Each target module has C adaptors of rank r; client k
mixes them with its own router ``pi_k = softmax(logits_k / T)``, which never
leaves the client. The server averages adaptor c over the round's clients with
weights ``p(k|c) = p_k pi_kc / sum_j p_j pi_jc``, so a client contributes to
the adaptors its router actually uses. With C = 1 this is FedIT.
"""

from __future__ import annotations

import torch

from fedllm.aggregation._linalg import weighted_mean
from fedllm.aggregation.base import ClientStart, ClientUpdate, GlobalState, RoundResult, Strategy
from fedllm.config import ConfigError
from fedllm.factors import Adapter, LoraFactors


def adaptor_weights(updates: list[ClientUpdate], weights: list[float], num_adaptors: int) -> torch.Tensor:
    """``K x C`` matrix of p(k|c): columns sum to one."""
    probs = torch.stack([u.extras["router_probs"].double() for u in updates])  # K x C
    joint = torch.tensor(weights, dtype=torch.float64)[:, None] * probs
    return joint / joint.sum(0, keepdim=True)


class FLoRAL(Strategy):
    """Average each adaptor with router-weighted example weights.

    Client: loads the C global adaptors (a rank C*r adapter), mixes them with
    its local router (stateful across rounds, or re-learned from zero), trains
    adaptors and router, and uploads the adaptors and its mean router
    probabilities, never the router logits.
    """

    name = "floral"
    uses_routers = True

    def __init__(self, num_adaptors: int = 2) -> None:
        if num_adaptors < 1:
            raise ConfigError(f"aggregation.num_adaptors = {num_adaptors} is invalid: expected an integer >= 1")
        super().__init__(num_adaptors=num_adaptors)
        self.num_adaptors = num_adaptors

    @classmethod
    def from_config(cls, agg) -> FLoRAL:
        return cls(num_adaptors=agg.num_adaptors)

    @classmethod
    def check_config(cls, cfg) -> None:
        ranks = set(cfg.lora.ranks) | set(cfg.lora.rank_distribution)
        if len(ranks) != 1:
            raise ConfigError(
                f"aggregation.name = floral mixes C adaptors of one rank r: set lora.ranks to a single rank "
                f"(got {sorted(ranks)})"
            )

    def adapter_rank(self, rank: int) -> int:
        return self.num_adaptors * rank

    def aggregate_factors(self, updates: list[ClientUpdate], weights: list[float], state: GlobalState) -> RoundResult:
        c = self.num_adaptors
        w = adaptor_weights(updates, weights, c)
        out: Adapter = {}
        for key in updates[0].factors:
            folded = [u.factors[key].folded() for u in updates]
            r = folded[0].rank // c
            a_blocks, b_blocks = [], []
            for i in range(c):
                wi = [float(x) for x in w[:, i]]
                a_blocks.append(weighted_mean([f.A[i * r:(i + 1) * r] for f in folded], wi))
                b_blocks.append(weighted_mean([f.B[:, i * r:(i + 1) * r] for f in folded], wi))
            out[key] = LoraFactors(torch.cat(a_blocks), torch.cat(b_blocks, dim=1), 1.0)
        return RoundResult(GlobalState(out, dict(state.residual), extras=dict(state.extras)),
                           info={"router_mass": [float(x) for x in torch.stack(
                               [u.extras["router_probs"] for u in updates]).mean(0)]})

    def client_start(self, state: GlobalState, rank: int, scale: float, merged: Adapter,
                     client_id: int | None = None) -> ClientStart:
        if not state.factors:
            return ClientStart(None, merged)
        return ClientStart({k: f.with_scale(scale) for k, f in state.factors.items()}, merged)

    def global_adapter(self, state: GlobalState) -> Adapter:
        """The global model: the uniform mixture (every adaptor weighted 1/C)."""
        return {k: LoraFactors(f.A, f.B / self.num_adaptors, f.scale) for k, f in state.factors.items()}
