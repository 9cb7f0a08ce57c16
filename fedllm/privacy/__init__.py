"""User-level differential privacy: DP-FedAvg (McMahan et al., ICLR 2018) as a feature in its own room.

What is protected: a client's whole contribution to a round (user-level), i.e. the change of everything it
uploads (LoRA factors at its rank, in the aggregation space where the scale is folded into B, the dense
modules the config shares, and the extras that are parameters), bounded to L2 norm ``C =
privacy.clip_norm``.

* **central** (a strategy whose aggregate is linear in the uploads: FedIT, FFA-LoRA): each client clips its
  change to C (:class:`~fedllm.privacy.transform.ClipAndNoise`, an upload transform); the server's
  strategy is wrapped (:class:`~fedllm.privacy.strategy.DPStrategy`): it clips again, lets the inner
  strategy aggregate with uniform weights over the m clients sampled, and adds Gaussian noise of standard
  deviation ``sigma C / m`` to the result.
* **local** (any strategy whose uploads are all parameters): each client adds noise of standard deviation
  ``sigma C`` to its own clipped change before it leaves; the server aggregates as the strategy does.
* **distributed** (a linear strategy on Flower with ``flower.secure_aggregation=true``): each client clips
  and adds its share ``sigma C / sqrt(m)`` of the noise; the server sees only the sum (SecAgg+), which
  carries ``sigma C`` as central mode's does, and is accounted as central mode (``fedllm/secagg``).

The sample: by default (``privacy.sampling=secret``) each round's clients are drawn from the operating
system's randomness, the run folder never names them (rows carry counts only; the ledger totals only),
and the accountant amplifies by sampling (m of N without replacement, the sampled Gaussian of Wang, Balle
and Kasiviswanathan, AISTATS 2019). With ``privacy.sampling=public`` the run's seeded sample is used and
written as usual, and the reported epsilon is the unamplified Gaussian over the rounds the most-sampled
client took part in, which is what an adversary who knows ``federation.seed`` faces. Accounting:
Google's dp-accounting (RDP), "replace one client" (sensitivity 2C). Local mode is accounted per client
as the Gaussian composed over every round.

The feature hooks the core only from outside (``fedllm/features.py``): it wraps the strategy, sets the
server's policy (uniform weights; the fixed clip instead of the data-dependent median one in central
mode), replaces the sampling, adds the clients' upload transform, and adds the ``fedllm privacy``
command; the server, the runtime and the round loop do not know it exists.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any

from fedllm.aggregation.base import STRATEGIES
from fedllm.options import Rule, chosen_option
from fedllm.privacy.accountant import (
    MEANINGFUL_DELTA,
    default_delta,
    epsilon,
    noise_for_epsilon,
    round_up,
    unamplified,
)
from fedllm.privacy.options import PrivacyOptions
from fedllm.privacy.sampling import SecretSampling, max_participation
from fedllm.privacy.strategy import DPStrategy
from fedllm.privacy.transform import ClipAndNoise
from fedllm.protocol import Feature, sample_size

__all__ = ["PRIVACY", "PrivacyFeature", "PrivacyOptions", "default_delta", "epsilon", "noise_for_epsilon"]


def per_round(cfg) -> int:
    """Clients sampled each round (the sampling the server does)."""
    fed = cfg.federation
    return sample_size(fed.clients_per_round, fed.client_fraction, fed.num_clients)


def delta_of(cfg) -> float:
    return cfg.privacy.delta or default_delta(cfg.federation.num_clients)


def accounted(mode: str) -> str:
    """The accountant's mode: distributed DP (secure aggregation, each site a share of the noise) releases
    what central DP releases, and is accounted as it."""
    return "central" if mode == "distributed" else mode


def spent(cfg, rounds: int) -> float:
    """Epsilon at ``delta`` after ``rounds`` rounds (skipped rounds count: their clients were sampled)."""
    p = cfg.privacy
    if (
        accounted(p.mode) == "central" and p.sampling == "public"
    ):  # the adversary knows who took part in which round
        k = max_participation(cfg.federation.seed, cfg.federation.num_clients, per_round(cfg), rounds)
        return unamplified(p.noise_multiplier, k, delta_of(cfg))
    return epsilon(
        accounted(p.mode),
        cfg.federation.num_clients,
        per_round(cfg),
        p.noise_multiplier,
        rounds,
        delta_of(cfg),
    )


def _on(cfg) -> bool:
    return cfg.privacy.mode != "none"


class DeltaWarning(UserWarning):
    """The default delta (1 / N^1.1) of a small federation is too large to be a guarantee."""


def guarantee_line(eps: float, delta: float, what: str) -> str:
    """One line of the run's guarantees: ``(eps, delta)-DP ...``, or, where delta passes
    :data:`MEANINGFUL_DELTA`, a line that says there is none (never such a delta printed as a guarantee)."""
    if delta > MEANINGFUL_DELTA:
        return (
            f"no differential-privacy guarantee: delta {delta:.2g} > {MEANINGFUL_DELTA:g} (epsilon {eps:.4g} "
            f"{what}); set privacy.delta"
        )
    return f"({eps:.4g}, {delta:.2g})-DP {what}"


def server_epsilon(precision: float, delta: float) -> float:
    """Epsilon of a site's update against the server under distributed DP: the Gaussians of the rounds
    (multiplier ``sigma sqrt(n_r / m_r)``, the finishing sites' noise) compose into one Gaussian whose
    ``1 / multiplier^2`` is their sum, ``precision``; no amplification (the server draws the sample)."""
    if precision <= 0:
        return 0.0
    if not math.isfinite(precision):
        return math.inf
    return unamplified(1.0 / math.sqrt(precision), 1, delta)


class AgainstServer:
    """Distributed DP's guarantee against the server (see :func:`server_epsilon`): each round's precision
    from the sites that finished it, and the report of a run's composed precision."""

    def __init__(self, cfg) -> None:
        self.delta = delta_of(cfg)
        self.noise_multiplier = cfg.privacy.noise_multiplier
        self.per_round = per_round(cfg)  # each site's share of the noise is sigma C / sqrt(per_round)

    def precision(self, finished: int) -> float:
        """``1 / multiplier^2`` of a round in which ``finished`` sites' noise reached the server."""
        z2 = self.noise_multiplier**2 * finished / self.per_round
        return 1.0 / z2 if z2 > 0 else math.inf

    def report(self, precision: float) -> dict[str, Any]:
        eps = server_epsilon(precision, self.delta)
        what = (
            "of each site's update against the server itself (no amplification: it draws the sample and "
            "SecAgg+ names each round's sites; only the sites' own noise, every round counted as if the site "
            "took part; a site that colludes with it removes its share)"
        )
        return {"epsilon": eps, "delta": self.delta, "line": guarantee_line(eps, self.delta, what)}


def against_server(cfg) -> AgainstServer:
    return AgainstServer(cfg)


class PrivacyFeature(Feature):
    """Differential privacy as a feature (see module docstring)."""

    section = "privacy"
    options = PrivacyOptions

    # ------------------------------------------------------------------ config
    def rules(self) -> list[Rule]:
        return [
            Rule(
                "central DP needs a linear aggregate",
                lambda cfg, s, a: accounted(cfg.privacy.mode) == "central" and not s.linear,
                lambda cfg, s, a: (
                    f"privacy.mode={cfg.privacy.mode} needs a strategy whose aggregate is a weighted sum of "
                    "the uploads ("
                    + ", ".join(sorted(n for n, c in STRATEGIES.items() if c.linear))
                    + f"); aggregation.name={cfg.aggregation.name} needs each client's own factors: use "
                    "privacy.mode=local"
                ),
            ),
            Rule(
                "distributed DP needs secure aggregation",
                lambda cfg, s, a: cfg.privacy.mode == "distributed" and not cfg.flower.secure_aggregation,
                lambda cfg, s, a: (
                    "privacy.mode=distributed: each site adds only 1/sqrt(m) of the noise, so without "
                    "flower.secure_aggregation=true the server would see every site's update nearly bare; "
                    "set it, or use privacy.mode=central or local"
                ),
            ),
            Rule(
                "central DP's server clips each update",
                lambda cfg, s, a: cfg.flower.secure_aggregation and cfg.privacy.mode == "central",
                lambda cfg, s, a: (
                    "flower.secure_aggregation=true: privacy.mode=central has the server clip each update "
                    "and add the noise; use privacy.mode=distributed (each site adds its share before "
                    "masking)"
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
                lambda cfg, s, a: _on(cfg) and chosen_option(cfg, "aggregation", "robust", "none") != "none",
                lambda cfg, s, a: (
                    "privacy: aggregation.fedit.robust is data-dependent; the fixed clip bounds each client"
                ),
            ),
        ]

    def hidden_sample(self, p: PrivacyOptions, cfg) -> str:
        if accounted(p.mode) != "central" or p.sampling != "secret":  # local DP claims no amplification
            return ""
        return (
            "privacy.sampling = secret: the accountant's amplification assumes the sample hidden (or use "
            "privacy.sampling=public: epsilon without amplification)"
        )

    def check_config(self, p: PrivacyOptions, cfg) -> None:
        if p.mode == "none":
            default = PrivacyOptions()
            ignored = [
                f.name for f in dataclasses.fields(p) if getattr(p, f.name) != getattr(default, f.name)
            ]
            if ignored:
                raise ValueError(
                    "privacy.mode=none ignores "
                    + ", ".join(f"privacy.{k}" for k in ignored)
                    + ": the run would not be private; set privacy.mode=central or local, or leave them out"
                )
            return
        if not p.delta and default_delta(cfg.federation.num_clients) > MEANINGFUL_DELTA:
            warnings.warn(
                f"privacy.delta: the default 1/N^1.1 = {default_delta(cfg.federation.num_clients):.2g} for "
                f"{cfg.federation.num_clients} clients is above {MEANINGFUL_DELTA:g} and no guarantee (the "
                "run reports none); set privacy.delta explicitly (e.g. 1e-5)",
                DeltaWarning,
                stacklevel=2,
            )
        if cfg.flower.secure_aggregation and cfg.secagg.clip_norm not in (0.0, p.clip_norm):
            raise ValueError(
                f"secagg.clip_norm={cfg.secagg.clip_norm}: with privacy.mode={p.mode} the sites clip to "
                f"privacy.clip_norm={p.clip_norm}; leave secagg.clip_norm at 0"
            )
        if p.target_epsilon > 0:
            eps = spent(cfg, cfg.federation.rounds)
            if eps > p.target_epsilon:
                if accounted(p.mode) == "central" and p.sampling == "public":
                    k = max_participation(
                        cfg.federation.seed, cfg.federation.num_clients, per_round(cfg), cfg.federation.rounds
                    )
                    need = noise_for_epsilon(p.target_epsilon, "local", 1, 1, k, delta_of(cfg))
                else:
                    need = noise_for_epsilon(
                        p.target_epsilon,
                        accounted(p.mode),
                        cfg.federation.num_clients,
                        per_round(cfg),
                        cfg.federation.rounds,
                        delta_of(cfg),
                    )
                raise ValueError(
                    f"privacy.target_epsilon={p.target_epsilon}: {cfg.federation.rounds} rounds at "
                    f"noise_multiplier={p.noise_multiplier} spend epsilon {eps:.6g}; use "
                    f"privacy.noise_multiplier={round_up(need, 4):.4f} or fewer rounds"
                )

    # ------------------------------------------------------------------ the core's hooks
    def wrap_strategy(self, strategy, p: PrivacyOptions, cfg):
        if p.mode == "none":
            return strategy
        return DPStrategy(
            strategy,
            mode=p.mode,
            clip_norm=p.clip_norm,
            noise_multiplier=p.noise_multiplier,
            noise_seed=p.noise_seed,
            epsilon_after=lambda rounds: spent(cfg, rounds),
            summary=lambda rounds: self.summary(cfg, rounds),
            report_clip_stats=p.report_clip_stats,
            against_server=against_server(cfg) if p.mode == "distributed" else None,
        )

    def server_policy(self, policy, p: PrivacyOptions, cfg):
        if p.mode == "none":
            return policy
        # uniform weights (never the example counts); in central mode the fixed clip of the wrapper
        # replaces the median-relative one, whose cap depends on the other clients' data
        ratio = 0.0 if accounted(p.mode) == "central" else policy.clip_norm_ratio
        # no statistics of single updates in the rows (their norms are what the noise hides)
        return dataclasses.replace(policy, weighting="uniform", clip_norm_ratio=ratio, norm_stats=False)

    def sampling(self, sampling, p: PrivacyOptions, cfg):
        if p.mode == "none" or p.sampling == "public":
            return sampling
        return SecretSampling(
            seed=sampling.seed,
            clients_per_round=sampling.clients_per_round,
            fraction=sampling.fraction,
            dropout=sampling.dropout,
            noise_seed=p.noise_seed,
            # local DP claims no amplification by sampling: its sample needs no hiding and may be named
            public=accounted(p.mode) != "central",
        )

    def upload_transforms(self, p: PrivacyOptions, cfg) -> list:
        if p.mode == "none":
            return []
        # distributed mode: clip only here; each site's share of the noise goes on its whole padded vector,
        # where secure aggregation builds it (fedllm/secagg: every coordinate of the sum, as central mode's)
        std = p.noise_multiplier * p.clip_norm if p.mode == "local" else 0.0
        return [ClipAndNoise(p.clip_norm, std, p.noise_seed)]

    def add_commands(self, subparsers) -> None:
        from fedllm.privacy.cli import add_privacy_command

        add_privacy_command(subparsers)

    # ------------------------------------------------------------------ what a run reports
    def summary(self, cfg, rounds: int) -> dict[str, Any]:
        p = cfg.privacy
        eps, delta = spent(cfg, rounds), delta_of(cfg)
        n, m = cfg.federation.num_clients, per_round(cfg)
        sample = (
            f"{m} of {n} clients per round, without replacement, from the OS's randomness (not written to "
            "the run folder)"
            if p.sampling == "secret"
            else f"{m} of {n} clients per round from federation.seed (public: no amplification)"
        )
        return {
            "privacy": {
                "mode": p.mode,
                "clip_norm": p.clip_norm,
                "noise_multiplier": p.noise_multiplier,
                "delta": delta,
                "epsilon": eps,
                "rounds": rounds,
                "sampling": sample,
                "accountant": "dp-accounting RDP, replace-one (sensitivity 2C)"
                + (
                    ", as central (the sites' noise shares sum to sigma C)" if p.mode == "distributed" else ""
                ),
            },
            "metrics": {"epsilon": eps},
            "guarantees": [
                guarantee_line(
                    eps,
                    delta,
                    f"at the user level after {rounds} rounds, {p.mode} (clip {p.clip_norm:g}, noise "
                    f"multiplier {p.noise_multiplier:g}; {sample})"
                    + (
                        "; against whoever sees only the released models, provided the server follows the "
                        "protocol (keeps the sample secret, adds the noise of sites that drop)"
                        if p.mode == "distributed"
                        else ""
                    ),
                )
            ],
        }


PRIVACY = PrivacyFeature()
