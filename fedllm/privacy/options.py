"""The ``privacy.*`` section: the mode, the clip, the noise, the sample's secrecy, the accountant's
target."""

from __future__ import annotations

from dataclasses import dataclass

from fedllm.options import nonneg, one_of, opt, positive


@dataclass
class PrivacyOptions:
    """``privacy.*``: user-level differential privacy (DP-FedAvg) and its accountant."""

    mode: str = opt(
        "none",
        "user-level differential privacy (DP-FedAvg): 'central' (clients clip, the server noises the sum: "
        "fedit, ffa), 'local' (each client noises its own clipped update), 'distributed' (each site adds "
        "its share of central's noise; needs flower.secure_aggregation=true) or 'none'",
        *one_of("none", "central", "local", "distributed"),
    )
    clip_norm: float = opt(
        1.0,
        "L2 bound C of each client's update (everything it uploads, in the aggregation space)",
        positive,
        "> 0",
    )
    noise_multiplier: float = opt(
        1.0, "Gaussian noise standard deviation in units of clip_norm (see `fedllm privacy`)", nonneg, ">= 0"
    )
    delta: float = opt(
        0.0, "the delta of (epsilon, delta)-DP (0: 1 / num_clients^1.1)", lambda x: 0 <= x < 1, "in [0, 1)"
    )
    target_epsilon: float = opt(
        0.0,
        "refuse a run whose planned rounds would spend more than this epsilon (0: no limit)",
        nonneg,
        ">= 0",
    )
    sampling: str = opt(
        "secret",
        "secret: each round's clients are drawn from the OS's randomness and never written to the run "
        "folder, and the accountant amplifies by sampling; public: the run's seeded sample (reproducible, "
        "written to metrics.jsonl), accounted without amplification over each client's own participation",
        *one_of("secret", "public"),
    )
    noise_seed: int = opt(
        -1,
        "-1: noise (and a secret sample) from the OS's randomness (the guarantee); >= 0: both reproducible "
        "from this seed, for experiments only (anyone who knows the seed can remove the noise)",
        lambda x: x >= -1,
        "an integer >= -1",
    )
    report_clip_stats: bool = opt(
        False,
        "also write how many updates the server clipped and their median norm to metrics.jsonl (exact "
        "functions of the clients' data: outside the guarantee)",
    )
