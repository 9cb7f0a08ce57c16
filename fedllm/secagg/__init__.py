"""Secure aggregation: the server learns the sum of each round's uploads, never one site's, as a feature in
its own room (``flower.secure_aggregation=true``, parameters in ``secagg.*``).

The protocol is Flower's own SecAgg+ (Bell et al., CCS 2020; ``flwr.server.workflow.SecAggPlusWorkflow`` on
the server, ``flwr.client.mod.secaggplus_mod`` on the sites): each site masks its quantized vector with
pairwise masks agreed with its neighbours and a private one, secret-shares what rebuilds them, and the server
unmasks only the sum, recovering the masks of sites that drop after sharing their keys. fedllm adds what makes
a federated LoRA round a sum of fixed-shape vectors (:mod:`fedllm.secagg.summand`): each site's clipped
change, zero-padded from its rank to the federation's largest, in a layout the server fixes per round. Only
strategies whose aggregate is a weighted sum of the uploaded factors can run on it
(``Strategy.sums_uploads``: FedIT, FFA-LoRA, FedSVD, RoLoRA, FedSA-LoRA without B sharing); the config refuses
the others, each with why.

What the server can no longer check, and what it still can, is the trust table of docs/trust.md: it sees
neither a site's update (so no per-update finiteness check, median clip, or norm report), only the sum's shape
and the protocol's quorum; each site clips before masking (``secagg.clip_norm``, or ``privacy.clip_norm``), so
a site that follows the code moves the sum by at most the clip, while a hostile site can mask any integers
of the field (values, or its weight); the server refuses a mean outside the protocol's range, so such a site
moves each value of the mean by at most twice the range (``clipping_range``).

With ``privacy.mode=distributed`` each site adds its share ``N(0, (sigma C)^2 / m)`` of the noise before
masking, so the sum carries central DP's ``N(0, (sigma C)^2)`` without the server ever adding it; the
accountant is central mode's (``fedllm/privacy``). A site that drops out leaves its share missing: the server
adds it (and says so in the round's row, ``dp_server_noise_share``), which trusts the server for that part.

The feature hooks the core from outside only: an upload transform on the sites (the change the vector
carries), the Flower driver's exchange (``train_exchange``: the protocol's round instead of one message per
site), and a ClientApp mod (the protocol's stages; other messages pass through).
"""

from __future__ import annotations

import dataclasses
import math

from fedllm.options import Rule, chosen_option
from fedllm.protocol import Feature, TrainExchange
from fedllm.secagg.bounds import clip_of, clipping_range, per_round, private, quantization_bits
from fedllm.secagg.guard import threshold_for
from fedllm.secagg.options import SecAggOptions
from fedllm.secagg.summand import SecureSummand

__all__ = ["SECAGG", "SecAggOptions", "SecureAggregationFeature"]

# why each strategy that is not a weighted sum of the uploads cannot run on a sum
WHY_NOT = {
    "flora": "stacks each client's factors",
    "flexlora": "takes the SVD of each client's product",
    "florist": "stacks each client's factors for its SVD",
    "hetlora": "weights each update by its own norm",
    "floral": "averages each router with its own client's weights",
    "fedex": "adds the residual of each client's own product",
    "fedsa": "with aggregation.fedsa.share_b_every > 0 averages the shared B over the clients that send it "
    "that round only",
    "fedsb": "sends R and its initialization steps as strategy extras, which the secure layout does not "
    "carry yet",
    "local": "aggregates nothing",
}


def _on(cfg) -> bool:
    return bool(cfg.flower.secure_aggregation)


def neighbourhood(num_shares: float, m: int) -> int:
    """The neighbourhood Flower's ``SecAggPlusWorkflow`` derives from a fractional ``num_shares`` for ``m``
    sites (odd when it is not all of them, all of them when it would be 2 or fewer)."""
    share = round(num_shares * m)
    if share < m and share % 2 == 0:
        share += 1
    return m if share <= 2 else share


class SecureAggregationFeature(Feature):
    """Secure aggregation as a feature (see module docstring)."""

    section = "secagg"
    options = SecAggOptions

    def rules(self) -> list[Rule]:
        return [
            Rule(
                "secure aggregation sums the uploads",
                lambda cfg, s, a: _on(cfg) and not s.sums_uploads(cfg),
                lambda cfg, s, a: (
                    f"flower.secure_aggregation=true: the server learns only the sum of the uploads, and "
                    f"aggregation.name={cfg.aggregation.name} "
                    + WHY_NOT.get(cfg.aggregation.name, "is not a weighted sum of the uploads")
                    + "; use fedit, ffa, fedsvd, rolora or fedsa (without B sharing)"
                ),
            ),
            Rule(
                "secure aggregation carries the model update only",
                lambda cfg, s, a: _on(cfg) and a.uploads_extras,
                lambda cfg, s, a: (
                    f"flower.secure_aggregation=true: client.algorithm={cfg.client.algorithm} uploads its "
                    "own tensors (control-variate changes) beside the update; use sft, fedprox or perfedavg"
                ),
            ),
            Rule(
                "robust rules need each update",
                lambda cfg, s, a: _on(cfg) and chosen_option(cfg, "aggregation", "robust", "none") != "none",
                lambda cfg, s, a: (
                    "flower.secure_aggregation=true: aggregation.fedit.robust="
                    f"{cfg.aggregation.fedit.robust} needs "
                    "each update, which the server no longer sees; sites clip before masking "
                    "(secagg.clip_norm)"
                ),
            ),
            Rule(
                "a weight cap needs each weight",
                lambda cfg, s, a: _on(cfg) and cfg.federation.max_client_weight < 1,
                lambda cfg, s, a: (
                    "flower.secure_aggregation=true: federation.max_client_weight caps each client's "
                    "share of an average the protocol computes; set it to 1"
                ),
            ),
            Rule(
                "the protocol quantizes",
                lambda cfg, s, a: _on(cfg) and cfg.comm.upload != "float32",
                lambda cfg, s, a: (
                    f"flower.secure_aggregation=true: comm.upload={cfg.comm.upload}: the protocol quantizes "
                    "each vector itself (secagg.quantization_bits); use comm.upload=float32"
                ),
            ),
        ]

    def check_config(self, o: SecAggOptions, cfg) -> None:
        if not _on(cfg):
            default = SecAggOptions()
            changed = [
                f.name for f in dataclasses.fields(o) if getattr(o, f.name) != getattr(default, f.name)
            ]
            if changed:
                raise ValueError(
                    f"secagg.{changed[0]} is set but flower.secure_aggregation is false: set "
                    "flower.secure_aggregation=true or leave secagg.* out"
                )
            return
        if not private(cfg) and o.clip_norm <= 0:
            raise ValueError(
                "secagg.clip_norm: flower.secure_aggregation=true needs the L2 bound each site clips its "
                "change to before masking (> 0; a plain run's agg_update_norm_median with "
                "aggregation.clip_norm_ratio set shows the scale), or a DP mode whose clip bounds it"
            )
        m, bits = per_round(cfg), quantization_bits(cfg)
        if bits < 4 or m * 2**bits >= 2**o.modulus_bits:
            raise ValueError(
                f"secagg.quantization_bits={bits}: the sum of {m} sites' values (each < 2^{bits}) must fit "
                f"the field 2^{o.modulus_bits} with at least 4 bits each; use secagg.quantization_bits <= "
                f"{o.modulus_bits - math.ceil(math.log2(m + 1))} or a larger secagg.modulus_bits"
            )
        if m < 3:
            raise ValueError(
                f"flower.secure_aggregation=true needs at least 3 clients per round (SecAgg+ shares each "
                f"site's secrets among the others); this config samples {m}"
            )
        share = neighbourhood(o.num_shares, m)
        t = threshold_for(o.reconstruction_threshold, share, o.colluders)
        if t > share:
            raise ValueError(
                f"secagg.colluders={o.colluders}: a round of {share} sites cannot withstand it (the "
                f"threshold would be {t} of {share}); use secagg.colluders <= {share - 1}"
            )

    def hides_site_figures(self, o: SecAggOptions, cfg) -> str:
        if not _on(cfg) or o.site_metrics:
            return ""
        return (
            "flower.secure_aggregation=true keeps each site's own evaluation and example count on the site "
            "(secagg.site_metrics=true sends them)"
        )

    def wrap_strategy(self, strategy, o: SecAggOptions, cfg):
        if not _on(cfg):
            return strategy
        from fedllm.secagg.report import SecureReport

        return SecureReport(strategy, self.summary(cfg))

    def summary(self, cfg) -> dict:
        """What the run's summary says of secure aggregation (its section and its guarantee line)."""
        o = cfg.secagg
        section = {
            "protocol": "Flower SecAgg+ (SecAggPlusWorkflow, secaggplus_mod)",
            "clip_norm": clip_of(cfg),
            "clipping_range": clipping_range(cfg),
            "quantization_bits": quantization_bits(cfg),
            "modulus_bits": o.modulus_bits,
            "num_shares": o.num_shares,
            "reconstruction_threshold": o.reconstruction_threshold,
        }
        line = (
            "secure aggregation: a server that follows Flower's SecAgg+ unmasks only the sum of each round's "
            f"uploads (each site's change clipped to {clip_of(cfg):g}, quantized to {quantization_bits(cfg)} "
            "bits; what it does not cover: docs/trust.md)"
        )
        return {"secure_aggregation": section, "guarantees": [line]}

    def server_policy(self, policy, o: SecAggOptions, cfg):
        if not _on(cfg):
            return policy
        # the median-relative clip needs each update's norm: the sites' own clip before masking replaces it
        return dataclasses.replace(policy, clip_norm_ratio=0.0)

    def upload_transforms(self, o: SecAggOptions, cfg) -> list:
        if not _on(cfg):
            return []
        # under DP, DP's own transform (before this one) clipped and noised the change: kept as it is
        return [SecureSummand(0.0 if private(cfg) else o.clip_norm)]

    def train_exchange(self, o: SecAggOptions, cfg) -> TrainExchange | None:
        if not _on(cfg):
            return None
        from fedllm.secagg.flower import SecureExchange

        return SecureExchange(o, cfg)

    def client_mods(self, sites) -> list:
        from fedllm.secagg.flower import secure_mod

        return [secure_mod(sites)]


SECAGG = SecureAggregationFeature()
