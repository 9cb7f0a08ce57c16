"""FLoRAL: federated mixtures of LoRA adaptors with client-specific routers.

Almansoori et al., "Collaborative and Efficient Personalization with Mixtures
of Adaptors" (FLoRAL, arXiv 2410.03497). Each target module has C adaptors of
rank r; client k mixes them with its own router ``pi_k = softmax(logits_k / T)``,
which never leaves the client. The server averages adaptor c of a module over
the round's clients with weights ``p(k|c) = p_k pi_kc / sum_j p_j pi_jc``,
where ``pi_kc`` is the router probability client k gives that module (with
per-layer routers, each layer's own), so a client contributes to the adaptors
its router actually uses. An adaptor that no client of the round uses (all
``p_j pi_jc`` zero, e.g. softmax underflow) is kept as it was. Optional bias
adaptors (C vectors per module) are averaged with the same weights. With
C = 1 this is FedIT.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from fedllm.aggregation.base import GlobalState, RoundContext, RoundResult, Strategy
from fedllm.aggregation.floral_mixture import MixtureOptions, MixtureSession
from fedllm.checks import ClientFailure, Expected, as_float32
from fedllm.factors import Adapter, LoraFactors, unprefixed, weighted_mean
from fedllm.options import nonneg, one_of, opt, positive
from fedllm.protocol import ClientHook, ClientUpdate

log = logging.getLogger(__name__)


@dataclass
class FloralOptions:
    num_adaptors: int = opt(2, "adaptors C per target module", positive, "an integer >= 1")
    router_temperature: float = opt(1.0, "softmax temperature of the router", positive, "> 0")
    router_lr: float = opt(1e-2, "learning rate of the router logits", positive, "> 0")
    router_optimizer: str = opt(
        "same",
        "how the router logits are stepped: same (a group of the client's optimizer, AdamW by default, "
        "scheduled with it) or sgd (plain SGD of their own at router_lr, no schedule: the reference code's, "
        "where routers train at 0.1)",
        *one_of("same", "sgd"),
    )
    router_noise: float = opt(
        1.0,
        "scale of the noise added to the router logits while training (the reference's: 1.0)",
        nonneg,
        ">= 0",
    )
    router_noise_dist: str = opt(
        "uniform",
        "the router noise's distribution: uniform (U[0, 1), the reference's) or gaussian (N(0, 1))",
        *one_of("uniform", "gaussian"),
    )
    router_granularity: str = opt(
        "client",
        "one router per client (the reference's default), per transformer block, or per target module (the "
        "reference's per-layer routers)",
        *one_of("client", "block", "module"),
    )
    router_server_temperature: bool = opt(
        False,
        "the server weights adaptors by softmax(logits / router_temperature) instead of softmax(logits) (the "
        "reference's server ignores the temperature)",
    )
    stateful_routers: bool = opt(True, "keep routers across rounds (else re-learn each round)")
    precondition_eps: float = opt(
        0.0, "LoRA preconditioning: the eps added to B^T B and A A^T (0: off)", nonneg, ">= 0"
    )
    bias_adaptors: bool = opt(False, "also C bias adaptors per target module, mixed by the router")


PROBS = "router_probs."
BIAS = "bias."


def adaptor_weights(updates: list[ClientUpdate], weights: list[float], key: str) -> Tensor:
    """``K x C`` matrix of p(k|c) for module ``key``; a column is all-NaN where no client uses adaptor c."""
    probs = torch.stack([u.extras[PROBS + key].double() for u in updates])  # K x C
    joint = torch.tensor(weights, dtype=torch.float64)[:, None] * probs
    mass = joint.sum(0, keepdim=True)
    return torch.where(mass > 0, joint / mass.clamp_min(torch.finfo(torch.float64).tiny), torch.nan)


class FloralClient(ClientHook):
    """FLoRAL's client side: the client's rank C*r adapter mixed by its own router
    (``fedllm/aggregation/floral_mixture.py``).

    The router is trained beside the adaptors at its own learning rate and
    kept on the client (stateful across rounds, or re-learned from zero each
    round); the session uploads the per-module router probabilities and the
    bias adaptors. A client's personalized model is its own router's mixture;
    the global model as it gets it is the uniform mixture.
    """

    personalizes = True
    local_params = True
    uploads_statistics = True  # its router probabilities
    keeps_state = True  # its router
    shared_extras = ("bias.",)  # its bias adaptors: averaged like the adaptors

    def __init__(self, router: MixtureOptions) -> None:
        self.router = router

    def session(
        self, model: Any, adapter: str, state: dict[str, Tensor], extras: dict[str, Tensor], view: str
    ) -> MixtureSession:
        own = view == "own" or (view == "train" and self.router.stateful)
        return MixtureSession(
            model, adapter, self.router, state if own and state else None, unprefixed(extras, BIAS)
        )


class FLoRAL(Strategy):
    """Average each adaptor with router-weighted example weights.

    Client (:class:`FloralClient`): loads the C global adaptors (a rank C*r
    adapter, and the C bias adaptors if enabled), mixes them with its local
    router, trains adaptors and router, and uploads the adaptors and its
    per-module router probabilities, never the router.
    """

    name = "floral"
    global_state = "per_client"  # each client's router
    hook = FloralClient
    same_weights = False  # adaptor c of client k weighs p(k|c), its router's share of c
    options = FloralOptions

    def __init__(self, num_adaptors: int = 2, **router: Any) -> None:
        """``router``: the clients' :class:`~fedllm.aggregation.floral_mixture.MixtureOptions` (but
        ``num_adaptors``)."""
        if num_adaptors < 1:
            raise ValueError(f"num_adaptors = {num_adaptors} is invalid: expected an integer >= 1")
        self.router = MixtureOptions(num_adaptors=num_adaptors, **router)  # the clients' routers
        self.num_adaptors = num_adaptors

    @classmethod
    def from_options(cls, o: FloralOptions) -> FLoRAL:
        return cls(
            num_adaptors=o.num_adaptors,
            temperature=o.router_temperature,
            noise=o.router_noise,
            noise_dist=o.router_noise_dist,
            granularity=o.router_granularity,
            server_temperature=o.router_server_temperature,
            stateful=o.stateful_routers,
            router_lr=o.router_lr,
            router_optimizer=o.router_optimizer,
            precondition_eps=o.precondition_eps,
            bias=o.bias_adaptors,
        )

    @classmethod
    def check_config(cls, cfg: Any) -> None:
        ranks = sorted(set(cfg.lora.ranks) | set(cfg.lora.rank_distribution))
        if len(ranks) != 1:
            raise ValueError(
                f"aggregation.name = {cls.name} mixes C adaptors of one rank r: set lora.ranks to a single "
                "rank "
                f"(got {ranks})"
            )

    def client_hook(self) -> FloralClient:
        return FloralClient(self.router)

    def accept_extras(self, extras: dict[str, Tensor], exp: Expected) -> dict[str, Tensor]:
        """Per module: the router probabilities (C values on the simplex, renormalized exactly) and, with bias
        adaptors, the C bias adaptors (C x out)."""
        c, out = self.num_adaptors, {}
        for key, (out_f, _) in exp.modules.items():
            probs = as_float32(PROBS + key, extras.get(PROBS + key), (c,))
            if (probs < 0).any() or abs(float(probs.sum()) - 1) > 1e-3:
                raise ClientFailure(f"{PROBS}{key} = {probs.tolist()} is not a probability vector")
            out[PROBS + key] = probs / probs.sum()
            if self.router.bias:
                out[BIAS + key] = as_float32(BIAS + key, extras.get(BIAS + key), (c, out_f))
        return out

    def adapter_rank(self, rank: int) -> int:
        return self.num_adaptors * rank

    def aggregate_factors(
        self,
        updates: list[ClientUpdate],
        weights: list[float],
        state: GlobalState,
        context: RoundContext | None = None,
    ) -> RoundResult:
        c = self.num_adaptors
        out: Adapter = {}
        extras = dict(state.extras)
        unused: dict[str, list[int]] = {}
        for key in updates[0].factors:
            w = adaptor_weights(updates, weights, key)
            folded = [u.factors[key].folded() for u in updates]
            before = state.factors.get(key)  # round 1 has none: every adaptor is then averaged
            r = folded[0].rank // c
            a_blocks, b_blocks = [], []
            for i in range(c):
                rows = slice(i * r, (i + 1) * r)
                if torch.isnan(w[0, i]) and before is not None:  # nobody's router uses it this round: keep it
                    unused.setdefault(key, []).append(i)
                    a_blocks.append(before.folded().A[rows])
                    b_blocks.append(before.folded().B[:, rows])
                    continue
                wi = [float(x) for x in w[:, i]] if not torch.isnan(w[0, i]) else weights
                a_blocks.append(weighted_mean([f.A[rows] for f in folded], wi))
                b_blocks.append(weighted_mean([f.B[:, rows] for f in folded], wi))
            out[key] = LoraFactors(torch.cat(a_blocks), torch.cat(b_blocks, dim=1), 1.0)
            if BIAS + key in updates[0].extras:
                extras[BIAS + key] = self._average_bias(key, updates, w, state.extras.get(BIAS + key))
        if unused:
            log.warning(
                "FLoRAL: %d module(s) had adaptors no client's router used this round (kept unchanged), "
                "e.g. %s adaptor(s) %s",
                len(unused),
                *next(iter(unused.items())),
            )
        mass = torch.stack(
            [torch.stack([u.extras[PROBS + k] for k in updates[0].factors]).mean(0) for u in updates]
        )
        info = {
            "router_mass": [float(x) for x in mass.mean(0)],
            "unused_adaptors": sum(map(len, unused.values())),
        }
        return RoundResult(GlobalState(out, dict(state.residual), extras=extras), info=info)

    @staticmethod
    def _average_bias(key: str, updates: list[ClientUpdate], w: Tensor, before: Tensor | None) -> Tensor:
        """Bias adaptor c of module ``key`` averaged with p(k|c); an unused one kept (zeros before
        round 1).
        """
        stacked = torch.stack([u.extras[BIAS + key].double() for u in updates])  # K x C x out
        out = torch.einsum("kc,kco->co", torch.nan_to_num(w), stacked).to(stacked.dtype)
        unused = torch.isnan(w[0])
        if unused.any():
            out[unused] = (before.double() if before is not None else torch.zeros_like(out))[unused]
        return out.float()

    def client_factors(self, state: GlobalState, rank: int, scale: float, client_id: int) -> Adapter | None:
        return {k: f.with_scale(scale) for k, f in state.factors.items()} if state.factors else None

    def client_extras(self, state: GlobalState, client_id: int) -> dict[str, Tensor]:
        return {k: v for k, v in state.extras.items() if k.startswith(BIAS)}

    def global_adapter(self, state: GlobalState) -> Adapter:
        """The global model: the uniform mixture (every adaptor weighted 1/C)."""
        return {k: LoraFactors(f.A, f.B / self.num_adaptors, f.scale) for k, f in state.factors.items()}

    def global_biases(self, state: GlobalState) -> dict[str, Tensor]:
        """The uniform mixture's bias per module (the mean of its C bias adaptors)."""
        return {k: v.mean(0) for k, v in unprefixed(state.extras, BIAS).items()}
