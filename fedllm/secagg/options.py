"""The ``secagg.*`` section: Flower's SecAgg+ parameters and the bound each site clips to before masking.

The switch itself is ``flower.secure_aggregation`` (a property of the Flower deployment); these options say
how the protocol runs when it is on."""

from __future__ import annotations

from dataclasses import dataclass

from fedllm.options import nonneg, opt, positive


def _fraction(x: float) -> bool:
    return 0 < x <= 1


@dataclass
class SecAggOptions:
    """``secagg.*``: Flower's SecAgg+ (``flwr.server.workflow.SecAggPlusWorkflow``) as fedllm runs it."""

    clip_norm: float = opt(
        0.0,
        "L2 bound of each site's change (everything it uploads, in the aggregation space) before it is "
        "masked: bounds what one site can add to the sum and the protocol's integer range (0: "
        "the DP clip when DP is on; required otherwise)",
        nonneg,
        ">= 0",
    )
    num_shares: float = opt(
        1.0,
        "the share of the round's sites each site's secrets are split among (SecAgg+'s neighbourhood; 1: "
        "all of them, SecAgg). Only 1 is accepted: with smaller, overlapping neighbourhoods a server can "
        "show each site a view consistent on its own and unmask one site (docs/trust.md); fedllm's sites "
        "refuse such rounds",
        lambda x: x == 1.0,
        "1 (every site is every other's neighbour)",
    )
    reconstruction_threshold: float = opt(
        0.67,
        "the share of a site's neighbours whose shares rebuild its masks (raised to what secagg.colluders "
        "needs): the protocol recovers from up to n - t of the round's n sites dropping after sharing keys. "
        "Against a server that follows the protocol, fewer than t colluding sites learn nothing of another's "
        "update; against one that deviates, a site is safe from c colluders only where t > (n + c) / 2, "
        "which fedllm's sites require for their own secagg-colluders (docs/trust.md's table)",
        _fraction,
        "in (0, 1]",
    )
    colluders: int = opt(
        1,
        "colluding sites the round's threshold must withstand against a deviating server: the threshold is "
        "at least floor((n + c) / 2) + 1 of the round's n sites (c = 1: 4 of 5, 5 of 7, 6 of 10), which "
        "fedllm's sites check against their own node config secagg-colluders (default 1)",
        nonneg,
        "an integer >= 0",
    )
    quantization_bits: int = opt(
        0,
        "bits of each value's integer quantization in [-range, range]; one step 2 range / 2^bits bounds the "
        "error of each value of the mean (0: the most the field holds for the round's sites, "
        "modulus_bits - ceil(log2(sites + 1)), at most 30)",
        lambda x: x == 0 or 4 <= x <= 30,
        "0 or in [4, 30] (Flower quantizes to int32)",
    )
    modulus_bits: int = opt(
        32,
        "bits of the protocol's field (a power of two > quantization); the sum of the round's sites must "
        "fit: sites x 2^quantization_bits < 2^modulus_bits",
        lambda x: 8 <= x <= 62,
        "in [8, 62]",
    )
    noise_tails: float = opt(
        7.0,
        "under distributed DP, each value's range is clip_norm + this many standard deviations of "
        "a site's noise share (a noise draw beyond it is clipped: probability 2.6e-12 per value at 7)",
        positive,
        "> 0",
    )
    site_metrics: bool = opt(
        False,
        "let the sites of a secure run send their own figures in the clear: each site's personalized "
        "evaluation (loss and accuracy per client id, in metrics.jsonl and summary.json) and, under uniform "
        "weighting, its example count (false: none of it leaves a site; a site pinned to "
        "secure-aggregation='required' never sends it)",
    )
    timeout_s: float = opt(
        0.0,
        "seconds each of the protocol's four stages waits for the sites (0: flower.round_timeout_s)",
        nonneg,
        ">= 0",
    )
