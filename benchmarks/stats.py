"""How sure a median ratio is: a distribution-free confidence interval for the median.

The interleaved runs (``worker ratio``) give one step-time ratio per round; the suite reports
their median. On a shared 2-core machine rounds scatter by several percent, so a median of
1.02x may or may not be above 1.0x. The interval here answers that without assuming any
distribution: for sorted ratios x(1) <= ... <= x(n), the population median lies in
[x(k), x(n+1-k)] with probability 1 - 2 P(Binomial(n, 1/2) <= k - 1), and ``k`` is the
largest for which that is at least the confidence asked for.

>>> median_interval([0.9, 1.0, 1.1, 1.2, 0.95, 1.05, 0.97, 1.01])  # 8 rounds: min to max
(0.9, 1.2, 0.9921875)
>>> goal_verdict((0.93, 0.99), 1.0)
'met'
"""

from __future__ import annotations

from collections.abc import Sequence
from math import comb

__all__ = ["goal_verdict", "median_interval"]


def _binomial_cdf(k: int, n: int) -> float:
    """P(Binomial(n, 1/2) <= k)."""
    return sum(comb(n, i) for i in range(k + 1)) / 2**n


def median_interval(
    values: Sequence[float], confidence: float = 0.95
) -> tuple[float, float, float]:
    """(low, high, coverage): order statistics that hold the median with probability
    ``coverage``, the narrowest pair whose coverage reaches ``confidence``. With too few values
    to reach it (fewer than 6 at 0.95) it is the whole range, and ``coverage`` says how sure
    that is."""
    if not values:
        raise ValueError("median_interval needs at least one value")
    ordered = sorted(values)
    n = len(ordered)
    k = 1
    while k < (n + 1) // 2 and 1 - 2 * _binomial_cdf(k, n) >= confidence:
        k += 1
    return ordered[k - 1], ordered[n - k], 1 - 2 * _binomial_cdf(k - 1, n)


def goal_verdict(interval: tuple[float, float], goal: float) -> str:
    """Whether a step-time ratio meets ``goal`` (at or below it): ``met`` when the whole
    interval is at or below, ``missed`` when all of it is above, else ``not resolved``
    (this run cannot tell)."""
    low, high = interval
    if high <= goal:
        return "met"
    if low > goal:
        return "missed"
    return "not resolved"
