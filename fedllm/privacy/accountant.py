"""The accountant: epsilon spent by DP-FedAvg's rounds, and the noise a target epsilon needs (dp-accounting).

Replacing one client ("replace one" neighbouring relation, N public) moves the sum of clipped changes by
up to 2C, and dp-accounting's noise multiplier is the noise's standard deviation over that L2 sensitivity,
so the accountant is given ``sigma / 2``. Central mode with a secret sample of m of N clients per round is
the sampled-without-replacement Gaussian (Wang, Balle and Kasiviswanathan, AISTATS 2019); without
amplification (local mode) it is the Gaussian composed over the rounds.
"""

from __future__ import annotations

import math

MEANINGFUL_DELTA = 1e-3  # a delta above this is no guarantee (it lets 1 record in 1,000 out whole)


def default_delta(num_clients: int) -> float:
    return 1.0 / num_clients**1.1


def epsilon(
    mode: str, num_clients: int, per_round: int, noise_multiplier: float, rounds: int, delta: float
) -> float:
    """Epsilon spent after ``rounds`` rounds at ``delta`` (see the module docstring for the analysis)."""
    import dp_accounting
    from dp_accounting.rdp import RdpAccountant

    if rounds <= 0:
        return 0.0
    if noise_multiplier <= 0:
        return math.inf
    rel = dp_accounting.NeighboringRelation.REPLACE_ONE
    gaussian = dp_accounting.GaussianDpEvent(noise_multiplier / 2)  # sensitivity 2C under replace-one
    if mode == "central" and per_round < num_clients:
        event = dp_accounting.SampledWithoutReplacementDpEvent(num_clients, per_round, gaussian)
    else:
        event = gaussian
    spent = []
    for e in {event, gaussian}:  # both bound the same mechanism: the sampled bound is not always tighter
        accountant = RdpAccountant(neighboring_relation=rel)
        accountant.compose(dp_accounting.SelfComposedDpEvent(e, rounds))
        spent.append(float(accountant.get_epsilon(delta)))
    return min(spent)


def noise_for_epsilon(
    target: float, mode: str, num_clients: int, per_round: int, rounds: int, delta: float
) -> float:
    """The smallest noise multiplier whose ``rounds`` rounds spend at most ``target`` epsilon, to a relative
    1e-6 (bisection on the accountant above, always keeping a multiplier that meets the target;
    dp-accounting's own calibration does the same search). Each step runs the accountant, so the
    search stops at that precision instead of a fixed, much finer, number of steps."""
    lo, hi = 1e-3, 1.0
    while epsilon(mode, num_clients, per_round, hi, rounds, delta) > target:
        lo, hi = hi, hi * 2
        if hi > 1e4:
            raise ValueError(f"no noise multiplier below 1e4 reaches epsilon {target}")
    while hi - lo > 1e-6 * hi:
        mid = (lo + hi) / 2
        if epsilon(mode, num_clients, per_round, mid, rounds, delta) > target:
            lo = mid
        else:
            hi = mid
    return hi


def unamplified(noise_multiplier: float, rounds: int, delta: float) -> float:
    """Epsilon of the Gaussian mechanism composed over ``rounds`` rounds, without amplification by sampling:
    the bound for a client whose participation is known (a public sample) or for local noise."""
    return epsilon("local", 1, 1, noise_multiplier, rounds, delta)


def round_up(x: float, digits: int) -> float:
    """``x`` rounded up at ``digits`` decimals: a noise multiplier printed for a target never falls below
    the one that meets it."""
    scale = 10**digits
    return math.ceil(x * scale - 1e-9) / scale
