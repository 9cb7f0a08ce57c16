"""User-level differential privacy: DP-FedAvg (McMahan et al., ICLR 2018) and its accountant.

What is protected: a client's whole contribution to a round (user-level),
i.e. the change of everything it uploads (LoRA factors at its rank, in the
aggregation space where the scale is folded into B, and the dense modules the
config shares), bounded to L2 norm ``C = privacy.clip_norm``.

* **central** (FedIT, FFA-LoRA): each client clips its change to C; the
  server clips again (a client that does not is bounded all the same), sums
  the clipped changes, adds Gaussian noise of standard deviation ``sigma * C``
  (``privacy.noise_multiplier``) to the sum and divides by the number of
  clients sampled, ``m`` (fixed: never the example counts). The released
  global factors (FedIT: A and B, each the noisy mean of the clients' changes
  added to the previous global; FFA-LoRA: B, A being frozen and public) are
  then differentially private, and so is every model built from them.
* **local** (any strategy but FLoRAL): each client adds that noise to its own
  clipped change before it leaves; the server aggregates the noisy updates
  as the strategy does (uniform weights). No trust in the server is needed,
  and no amplification by the sum either: the noise per client is m times
  larger relative to the average than in the central mode.

Sampling is fedllm's: m of the N clients, uniformly without replacement,
each round. The accountant is Google's dp-accounting (RDP, the
sampled-without-replacement Gaussian of Wang, Balle and Kasiviswanathan,
AISTATS 2019) under the "replace one client" neighbouring relation, where N
is public. Replacing one client changes the sum of clipped changes by up to
2C, and dp-accounting's noise multiplier is the noise's standard deviation
over that L2 sensitivity, so the accountant is given ``sigma / 2``. Local
mode is accounted per client as the Gaussian mechanism composed over every
round (a client may be sampled in each; the server sees who is).

Noise comes from the operating system's randomness unless
``privacy.noise_seed`` >= 0 makes it reproducible (for experiments: anyone
who knows the seed can subtract it).
"""

from __future__ import annotations

import logging
import math
import secrets
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from fedllm.aggregation.base import STRATEGIES, ClientUpdate, GlobalState, RoundResult
from fedllm.factors import Adapter, LoraFactors, init_factors
from fedllm.lowrank import pad_rank
from fedllm.options import Rule
from fedllm.privacy.accountant import default_delta, epsilon, noise_for_epsilon
from fedllm.privacy.options import PrivacyOptions
from fedllm.protocol import Feature, sample_size

log = logging.getLogger(__name__)


def per_round(cfg) -> int:
    """Clients sampled each round (the sampling the server does; see fedllm.server.Sampling)."""
    fed = cfg.federation
    return sample_size(fed.clients_per_round, fed.client_fraction, fed.num_clients)


def delta_of(cfg) -> float:
    return cfg.privacy.delta or default_delta(cfg.federation.num_clients)


def generator(seed: int, *parts: int) -> torch.Generator:
    """OS randomness (``seed`` -1) or, for experiments, a generator seeded by ``seed`` and ``parts``."""
    if seed < 0:
        return torch.Generator().manual_seed(secrets.randbits(62))
    mixed = seed
    for p in parts:
        mixed = (mixed * 1_000_003 + p + 1) % (1 << 62)
    return torch.Generator().manual_seed(mixed)


def clip_(changes: list[Tensor], clip_norm: float) -> float:
    """Scale the change tensors in place to a joint L2 norm of at most ``clip_norm``; returns the norm they
    had."""
    norm = math.sqrt(sum(float(c.double().pow(2).sum()) for c in changes))
    if norm > clip_norm:
        for c in changes:
            c.mul_(clip_norm / norm)
    return norm


def privatize_update(
    trained: Adapter,
    dense: dict[str, Tensor],
    start: Adapter,
    start_dense: dict[str, Tensor],
    clip_norm: float,
    noise_std: float,
    gen: torch.Generator,
) -> tuple[Adapter, dict[str, Tensor], float]:
    """A client's upload with its change clipped to ``clip_norm`` (and, for local DP, Gaussian noise of
    ``noise_std`` added to the change), measured in the aggregation space (B with its scale folded in).
    Returns the factors, the dense modules and the change's norm before clipping."""
    dA = {k: f.A - start[k].A for k, f in trained.items()}
    dB = {k: (f.B - start[k].with_scale(f.scale).B) * f.scale for k, f in trained.items()}
    dD = {k: t - start_dense[k] for k, t in dense.items()}
    changes = [*dA.values(), *dB.values(), *dD.values()]
    norm = clip_(changes, clip_norm)
    if noise_std > 0:
        for c in changes:
            c.add_(torch.randn(c.shape, generator=gen) * noise_std)
    factors = {
        k: LoraFactors(start[k].A + dA[k], start[k].with_scale(f.scale).B + dB[k] / f.scale, f.scale)
        for k, f in trained.items()
    }
    return factors, {k: start_dense[k] + dD[k] for k in dense}, norm


def noisy_mean(
    state: GlobalState,
    updates: list[ClientUpdate],
    references: list[Adapter],
    per_round: int,
    clip_norm: float,
    noise_std: float,
    gen: torch.Generator,
    base: Adapter,
    trains_a: bool = True,
) -> tuple[GlobalState, dict]:
    """Central DP-FedAvg on LoRA factors: ``global + (sum_k clip(change_k) + N(0, noise_std^2)) / m``.

    ``references``: what each client started from (the server's own derivation);
    ``base``: the global factors the changes are added to (the previous global,
    or the round-1 initialization every client started from), at the largest
    rank. A client's change covers its leading ``r_k`` components; the others
    it does not change. Dense modules the same way. Every update is clipped here
    again, so a client that did not clip is bounded all the same. ``trains_a`` False (FFA-LoRA): A is
    frozen and public, nothing is added to it.
    """
    sums = {k: [torch.zeros_like(f.A), torch.zeros_like(f.B)] for k, f in base.items()}
    dsum = {k: torch.zeros_like(t) for k, t in state.dense.items()}
    norms = []
    for u, ref in zip(updates, references, strict=True):
        parts: list[Tensor] = []
        for k, f in u.factors.items():
            r = ref[k].with_scale(f.scale)
            parts += [(f.A - r.A).double(), ((f.B - r.B) * f.scale).double()]
        parts += [(t - state.dense[k]).double() for k, t in u.dense.items()]
        norms.append(clip_(parts, clip_norm))
        it = iter(parts)
        for k, f in u.factors.items():
            da, db = next(it), next(it)
            sums[k][0][: f.rank] += da.float()
            sums[k][1][:, : f.rank] += db.float()
        for k in u.dense:
            dsum[k] += next(it).float()

    def noisy(t: Tensor) -> Tensor:
        return (t + torch.randn(t.shape, generator=gen) * noise_std) / per_round

    factors = {
        k: LoraFactors(
            base[k].A + noisy(sums[k][0]) if trains_a else base[k].A, base[k].B + noisy(sums[k][1]), 1.0
        )
        for k in base
    }
    dense = {k: state.dense[k] + noisy(dsum[k]) for k in dsum}
    info = {
        # updates the server had to clip: a site that did not clip (an honest site's clipped change
        # measures C up to float32 rounding, which is not counted)
        "dp_clipped": sum(n > clip_norm * (1 + 1e-4) for n in norms),
        "dp_update_norm_median": float(torch.tensor(norms).median()) if norms else 0.0,
    }
    return GlobalState(factors, dict(state.residual), dense=dense, extras=dict(state.extras)), info


def base_factors(state: GlobalState, modules: dict[str, tuple[int, int]], rank: int, seed: int) -> Adapter:
    """The global factors (folded) padded to ``rank``, or the round's shared initialization when there are
    none yet (every client of round 1 started from its leading rows)."""
    if state.factors:
        return {k: pad_rank(f.folded(), rank) for k, f in state.factors.items()}
    return {k: f.folded() for k, f in init_factors(modules, rank, 1.0, seed).items()}


@dataclass
class DPRules:
    """The privacy settings both halves apply (``privacy.*``, with the sampling's N and m)."""

    mode: str
    clip_norm: float
    noise_multiplier: float
    num_clients: int
    per_round: int
    delta: float
    noise_seed: int = -1

    @classmethod
    def from_config(cls, cfg) -> DPRules | None:
        p = cfg.privacy
        if p.mode == "none":
            return None
        return cls(
            p.mode,
            p.clip_norm,
            p.noise_multiplier,
            cfg.federation.num_clients,
            per_round(cfg),
            delta_of(cfg),
            p.noise_seed,
        )

    @property
    def noise_std(self) -> float:
        return self.noise_multiplier * self.clip_norm

    def spent(self, rounds: int) -> float:
        """Epsilon at ``delta`` after ``rounds`` rounds (skipped rounds count: the clients were sampled)."""
        return epsilon(self.mode, self.num_clients, self.per_round, self.noise_multiplier, rounds, self.delta)

    def summary(self, rounds: int) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "clip_norm": self.clip_norm,
            "noise_multiplier": self.noise_multiplier,
            "delta": self.delta,
            "epsilon": self.spent(rounds),
            "rounds": rounds,
            "sampling": f"{self.per_round} of {self.num_clients} clients per round, without replacement",
            "accountant": "dp-accounting RDP, replace-one (sensitivity 2C)",
        }

    def client_update(self, trained, dense, start, start_dense, round_idx: int, client_id: int):
        """A client's upload under DP: clipped (and, in local mode, noised) change."""
        gen = generator(self.noise_seed, round_idx, client_id, 1)
        std = self.noise_std if self.mode == "local" else 0.0
        return privatize_update(trained, dense, start, start_dense, self.clip_norm, std, gen)

    def aggregate(self, server, plan, updates: list[ClientUpdate]) -> RoundResult:
        """Central mode: the noisy mean of the clients' clipped changes (see :func:`noisy_mean`)."""
        refs = [server.reference(plan.round, u.client_id, plan.starts[u.client_id]) for u in updates]
        rank = max(server.strategy.adapter_rank(c.rank) for c in server.clients.values())
        base = base_factors(
            server.state, server.modules, rank, server.hook.fresh_seed(server.sampling.seed, plan.round)
        )
        gen = generator(self.noise_seed, plan.round, 0)
        state, info = noisy_mean(
            server.state,
            updates,
            refs,
            len(plan.sampled),
            self.clip_norm,
            self.noise_std,
            gen,
            base,
            trains_a="A" in server.hook.uploads,
        )
        return RoundResult(state, info=info)


def _on(cfg) -> bool:
    return cfg.privacy.mode != "none"


class PrivacyFeature(Feature):
    """Differential privacy as a feature: the ``privacy`` section and the combinations it refuses."""

    section = "privacy"
    options = PrivacyOptions

    def rules(self) -> list[Rule]:
        return [
            Rule(
                "central DP needs a linear aggregate",
                lambda cfg, s, a: cfg.privacy.mode == "central" and not s.linear,
                lambda cfg, s, a: (
                    "privacy.mode=central needs a strategy whose aggregate is a weighted sum of the uploads ("
                    + ", ".join(sorted(n for n, c in STRATEGIES.items() if c.linear))
                    + f"); aggregation.name={cfg.aggregation.name} needs each client's own factors: use "
                    "privacy.mode=local"
                ),
            ),
            Rule(
                "local DP noises every upload",
                lambda cfg, s, a: cfg.privacy.mode == "local" and s.hook.uploads_statistics,
                lambda cfg, s, a: (
                    f"privacy.mode=local: aggregation.name={cfg.aggregation.name} uploads statistics of the "
                    "data beside the factors (router probabilities), which no noise covers"
                ),
            ),
            Rule(
                "DP noises every upload",
                lambda cfg, s, a: _on(cfg) and a.uploads_extras,
                lambda cfg, s, a: (
                    f"privacy: client.algorithm={cfg.client.algorithm} uploads tensors beside the model "
                    "update (control-variate changes) without noise"
                ),
            ),
            Rule(
                "DP's sampling",
                lambda cfg, s, a: _on(cfg) and cfg.federation.dropout > 0,
                lambda cfg, s, a: (
                    "privacy: federation.dropout > 0 changes the sampling the accountant assumes"
                ),
            ),
            Rule(
                "DP's fixed clip",
                lambda cfg, s, a: _on(cfg) and cfg.aggregation.robust != "none",
                lambda cfg, s, a: (
                    "privacy: aggregation.robust is data-dependent; the fixed clip bounds each client"
                ),
            ),
        ]

    def check_config(self, p, cfg) -> None:
        if p.mode == "none" or p.target_epsilon <= 0:
            return
        n, m = cfg.federation.num_clients, per_round(cfg)
        eps = epsilon(p.mode, n, m, p.noise_multiplier, cfg.federation.rounds, delta_of(cfg))
        if eps > p.target_epsilon:
            need = noise_for_epsilon(p.target_epsilon, p.mode, n, m, cfg.federation.rounds, delta_of(cfg))
            raise ValueError(
                f"privacy.target_epsilon={p.target_epsilon}: {cfg.federation.rounds} rounds at "
                f"noise_multiplier={p.noise_multiplier} spend epsilon {eps:.3g}; use "
                f"privacy.noise_multiplier={need:.3f} or fewer rounds"
            )


PRIVACY = PrivacyFeature()
