"""The numbers a secure round is built on, from the config: the clip each site's change has before masking,
the noise each site adds, the protocol's range and quantization, and how the sites are weighted.

The one place where secure aggregation reads the differential-privacy settings it composes with
(``privacy.mode=distributed``: each site adds its share of the noise to its whole vector); the rest of
``fedllm/secagg`` asks these functions."""

from __future__ import annotations

import math

from fedllm.protocol import sample_size


def private(cfg) -> bool:
    """Whether DP is on: its clip bounds each site's change, and every site weighs 1."""
    return cfg.privacy.mode != "none"


def distributed(cfg) -> bool:
    """Whether each site adds its share of central DP's noise (the server then divides the sum by the sample
    size and adds the shares of the sites that did not finish)."""
    return cfg.privacy.mode == "distributed"


def uniform(cfg) -> bool:
    """Whether every site's weight is 1 (``federation.weighting=uniform``, or DP)."""
    return cfg.federation.weighting == "uniform" or private(cfg)


def noise_seed(cfg) -> int:
    """The seed of the sites' noise (-1: the operating system's randomness)."""
    return cfg.privacy.noise_seed


def known_noise(cfg) -> str:
    """Why a site pinned to secure aggregation refuses the config's noise (empty: it does not): under
    distributed DP a noise seed >= 0 is known to whoever sent the config, the server, which could then
    remove the site's noise."""
    if distributed(cfg) and noise_seed(cfg) >= 0:
        return (
            "privacy.noise_seed >= 0 under distributed DP: whoever knows the seed (the server that sent it) "
            "can remove this site's noise; a site pinned to secure aggregation adds noise from its own "
            "randomness only"
        )
    return ""


def per_round(cfg) -> int:
    fed = cfg.federation
    return sample_size(fed.clients_per_round, fed.client_fraction, fed.num_clients)


def clip_of(cfg) -> float:
    """The L2 bound each site's change has before masking: DP's clip when DP is on, else
    ``secagg.clip_norm``."""
    return cfg.privacy.clip_norm if private(cfg) else cfg.secagg.clip_norm


def noise_std(cfg) -> float:
    """The standard deviation of the noise each site adds to each value before masking (0 without DP)."""
    p = cfg.privacy
    share = {"local": 1.0, "distributed": per_round(cfg) ** -0.5}.get(p.mode, 0.0)
    return share * p.noise_multiplier * p.clip_norm


def clipping_range(cfg) -> float:
    """The protocol's per-value range: a clipped change's values are within its L2 bound; a noised one's
    also within ``secagg.noise_tails`` standard deviations of the noise."""
    return clip_of(cfg) + cfg.secagg.noise_tails * noise_std(cfg)


def quantization_bits(cfg) -> int:
    """``secagg.quantization_bits``, or (0) the most the field holds: the sum of the round's ``m`` sites'
    values, each below ``2^bits``, must stay below ``2^modulus_bits``."""
    o = cfg.secagg
    return o.quantization_bits or min(30, o.modulus_bits - math.ceil(math.log2(per_round(cfg) + 1)))


def quantization_error(cfg, weights: list[float] | None = None) -> float:
    """The most the protocol's quantization moves one value of the weighted mean of the round's vectors:
    stochastic rounding moves each site's weighted value by less than one step ``2 range / 2^bits``, and the
    mean divides the sum of those errors by the sum of the weights (each weight ``n_k / max_weight <= 1``;
    1 each under uniform weighting, where the bound is one step)."""
    step = 2 * clipping_range(cfg) / 2 ** quantization_bits(cfg)
    return step if weights is None else step * len(weights) / sum(weights)
