"""Paired comparisons that hold under multiple testing: Holm-adjusted p-values, Bonferroni-corrected
intervals and the smallest difference a design can detect.

A table of k methods over n seeds makes many comparisons at once; at 95 % each, one in twenty differences
that do not exist is called real. Within a family of m comparisons (every method against the baseline, or
every method against the best row) this module reports, per comparison, the mean per-seed difference, its
Student-t p-value, Holm's step-down adjustment of it (family-wise error at most ``alpha``; Holm 1979) and an
interval at level ``1 - alpha / m`` (Bonferroni's, which holds for all m at once). A verdict is given only
where that interval excludes zero, which implies Holm's rejection too. The minimum detectable difference is
the smallest true difference a paired t-test of the family's level finds with the given power, for per-seed
differences of the observed spread, solved exactly on the noncentral t.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from scipy import optimize, stats


@dataclass
class Comparison:
    """One paired comparison of a family, corrected for the family's size."""

    name: str
    diff: float  # mean per-seed difference (method minus reference)
    sd: float  # standard deviation of the per-seed differences
    n: int
    p: float  # two-sided paired t-test, uncorrected
    p_holm: float = math.nan
    low: float = math.nan  # Bonferroni interval at 1 - alpha / m
    high: float = math.nan

    @property
    def excludes_zero(self) -> bool:
        return self.low > 0 or self.high < 0


def paired_test(name: str, values: list[float], reference: list[float]) -> Comparison:
    """The per-seed differences ``values - reference`` and their two-sided t-test (p = 0 where every seed
    gives the same non-zero difference, 1 where every difference is 0; NaN where a value is not finite,
    e.g. the epsilon of a run without noise)."""
    diffs = [v - r for v, r in zip(values, reference, strict=True)]
    n, mean = len(diffs), statistics.fmean(diffs)
    finite = all(math.isfinite(d) for d in diffs)
    sd = statistics.stdev(diffs) if n > 1 and finite else math.nan
    if n < 2 or not finite:
        p = math.nan
    elif sd == 0:
        p = 1.0 if mean == 0 else 0.0
    else:
        p = float(2 * stats.t.sf(abs(mean) / (sd / math.sqrt(n)), n - 1))
    return Comparison(name, mean, sd, n, p)


def correct(family: list[Comparison], alpha: float = 0.05) -> list[Comparison]:
    """Holm's adjusted p-values and Bonferroni intervals for the family, in place (and returned)."""
    m = len(family)
    order = sorted(range(m), key=lambda i: (math.isnan(family[i].p), family[i].p))
    running = 0.0
    for rank, i in enumerate(order):
        c = family[i]
        if math.isnan(c.p):
            continue
        running = max(running, min(1.0, (m - rank) * c.p))
        c.p_holm = running
    for c in family:
        if c.n < 2 or math.isnan(c.sd):
            continue
        half = float(stats.t.ppf(1 - alpha / (2 * m), c.n - 1)) * c.sd / math.sqrt(c.n)
        c.low, c.high = c.diff - half, c.diff + half
    return family


def detectable(sd: float, n: int, m: int, alpha: float = 0.05, power: float = 0.8) -> float:
    """The smallest true mean difference a two-sided paired t-test at family level ``alpha`` over ``m``
    comparisons detects with probability ``power``, for per-seed differences of spread ``sd`` over ``n``
    seeds: solved exactly on the noncentral t (the textbook ``(t_crit + t_power) sd / sqrt(n)`` falls short
    by several points of power at 5 seeds)."""
    if n < 2 or not math.isfinite(sd):
        return math.nan
    if sd == 0:
        return 0.0
    df = n - 1
    crit = float(stats.t.ppf(1 - alpha / (2 * m), df))

    def shortfall(effect: float) -> float:
        nc = effect * math.sqrt(n) / sd
        lower = float(stats.nct.sf(crit, df, -nc))  # P(T < -crit) by symmetry (scipy's cdf is NaN there)
        return float(stats.nct.sf(crit, df, nc)) + (lower if math.isfinite(lower) else 0.0) - power

    high = (crit + float(stats.t.ppf(power, df))) * sd / math.sqrt(n)
    while shortfall(high) < 0:
        high *= 2
    return float(optimize.brentq(shortfall, 0.0, high, xtol=1e-9 * sd))
