"""The ``privacy.*`` section: the mode, the clip, the noise and the accountant's target."""

from __future__ import annotations

from dataclasses import dataclass

from fedllm.options import nonneg as _nonneg
from fedllm.options import opt
from fedllm.options import positive as _positive


@dataclass
class PrivacyOptions:
    """``privacy.*``: user-level differential privacy (DP-FedAvg) and its accountant."""

    mode: str = opt(
        "none",
        "user-level differential privacy (DP-FedAvg): 'central' (clients clip, the server noises the sum: "
        "fedit, ffa), 'local' (each client noises its own clipped update) or 'none'",
        lambda x: x in ("none", "central", "local"),
        "one of none, central, local",
    )
    clip_norm: float = opt(
        1.0,
        "L2 bound C of each client's update (everything it uploads, in the aggregation space)",
        _positive,
        "> 0",
    )
    noise_multiplier: float = opt(
        1.0, "Gaussian noise standard deviation in units of clip_norm (see `fedllm privacy`)", _nonneg, ">= 0"
    )
    delta: float = opt(
        0.0, "the delta of (epsilon, delta)-DP (0: 1 / num_clients^1.1)", lambda x: 0 <= x < 1, "in [0, 1)"
    )
    target_epsilon: float = opt(
        0.0,
        "refuse a run whose planned rounds would spend more than this epsilon (0: no limit)",
        _nonneg,
        ">= 0",
    )
    noise_seed: int = opt(
        -1,
        "-1: noise from the OS's randomness (the guarantee); >= 0: reproducible noise from this seed, for "
        "experiments only (anyone who knows the seed can remove the noise)",
        lambda x: x >= -1,
        "an integer >= -1",
    )
