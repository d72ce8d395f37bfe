"""Statistics shared by the detectors and ``compare``: the Mann-Whitney rank test, Benjamini-
Hochberg false discovery rate control, and exact order-statistic confidence intervals of
quantiles. numpy only (scipy is not a dependency); the formulas follow scipy's where it has one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, NDArray


def mann_whitney_greater(rank_sum: float, n1: int, n2: int, tie_sum: float) -> tuple[float, float]:
    """U of the first sample and the one-sided p-value that it ranks above the second by
    chance: the normal approximation with the tie correction and a continuity correction
    (scipy.stats.mannwhitneyu(..., alternative="greater", method="asymptotic")).

    ``rank_sum`` is the sum of the first sample's ranks in both samples together (ties get
    their average rank); ``tie_sum`` the sum of t^3 - t over groups of t equal values.
    """
    u = rank_sum - n1 * (n1 + 1) / 2.0
    n = n1 + n2
    mean = n1 * n2 / 2.0
    var = n1 * n2 / 12.0 * ((n + 1) - tie_sum / (n * (n - 1))) if n > 1 else 0.0
    if var <= 0:
        return u, 1.0  # every value equal: no evidence either way
    z = (u - mean - 0.5) / math.sqrt(var)
    return u, 0.5 * math.erfc(z / math.sqrt(2.0))


@dataclass(frozen=True)
class RankTest:
    u: float  # U of the second sample (pairs where it is larger, ties counting half)
    p_value: float  # two-sided
    # P(y > x) - P(y < x) for a random pair (Cliff's delta): > 0 when the second ranks higher.
    delta: float


def mann_whitney(x: ArrayLike, y: ArrayLike) -> RankTest:
    """Two-sided Mann-Whitney U test of ``y`` against ``x`` (scipy.stats.mannwhitneyu(y, x,
    method="asymptotic"): the normal approximation with tie and continuity corrections)."""
    a = np.asarray(x, dtype=np.float64)
    b = np.asarray(y, dtype=np.float64)
    n1, n2 = len(b), len(a)
    if n1 == 0 or n2 == 0:
        return RankTest(0.0, 1.0, 0.0)
    both = np.concatenate([b, a])
    ranks, tie_sum = _ranks(both)
    u = float(ranks[:n1].sum()) - n1 * (n1 + 1) / 2.0
    n = n1 + n2
    mean = n1 * n2 / 2.0
    var = n1 * n2 / 12.0 * ((n + 1) - tie_sum / (n * (n - 1))) if n > 1 else 0.0
    delta = 2.0 * u / (n1 * n2) - 1.0
    if var <= 0:
        return RankTest(u, 1.0, delta)
    z = (abs(u - mean) - 0.5) / math.sqrt(var)
    p = min(1.0, math.erfc(max(z, 0.0) / math.sqrt(2.0)))
    return RankTest(u, p, delta)


def _ranks(values: NDArray[np.float64]) -> tuple[NDArray[np.float64], float]:
    """Average ranks (1-based, ties get their mean rank) and the sum of t^3 - t over ties."""
    order = np.argsort(values, kind="mergesort")
    s = values[order]
    starts = np.flatnonzero(np.concatenate([[True], s[1:] != s[:-1]]))
    counts = np.diff(np.append(starts, len(s)))
    avg = starts + (counts + 1) / 2.0  # mean of ranks start+1 .. start+count
    ranks = np.empty(len(s), dtype=np.float64)
    ranks[order] = np.repeat(avg, counts)
    t = counts.astype(np.float64)
    return ranks, float((t * t * t - t).sum())


def benjamini_hochberg(p_values: Sequence[float]) -> list[float]:
    """Benjamini-Hochberg adjusted p-values (q-values): rejecting every hypothesis whose
    q <= alpha keeps the expected share of false discoveries among them at most alpha."""
    m = len(p_values)
    if m == 0:
        return []
    p = np.asarray(p_values, dtype=np.float64)
    order = np.argsort(p)
    scaled = p[order] * m / np.arange(1, m + 1)
    q_sorted = np.minimum.accumulate(scaled[::-1])[::-1]
    q = np.empty(m, dtype=np.float64)
    q[order] = np.minimum(q_sorted, 1.0)
    return [float(v) for v in q]


@dataclass(frozen=True)
class Quantile:
    value: float  # linear interpolation (numpy's default, DuckDB's quantile_cont)
    low: float  # an order-statistic confidence interval holding the true quantile
    high: float  # with at least the asked confidence (None-free: equal to value when n = 1)


def quantile_ci(sorted_values: NDArray[np.float64], q: float, confidence: float = 0.95) -> Quantile:
    """The ``q`` quantile of sorted values and its distribution-free confidence interval
    [x(l), x(u)]: the number of values under the true quantile is Binomial(n, q), so
    P(x(l) <= quantile <= x(u)) >= the binomial mass between l and u - 1 (the interval is the
    shortest symmetric-in-probability one with at least ``confidence`` coverage; it runs to the
    sample's extremes when n is too small for that coverage)."""
    x = sorted_values
    n = len(x)
    if n == 0:
        return Quantile(math.nan, math.nan, math.nan)
    value = float(np.quantile(x, q))
    cdf = _binomial_cdf(n, q)  # cdf[k] = P(B <= k), k = 0..n
    tail = (1.0 - confidence) / 2.0
    # l: the largest l (1-based order statistic) with P(B <= l - 1) <= tail
    lo_idx = int(np.searchsorted(cdf, tail, side="right"))  # number of k with cdf[k] <= tail
    # u: the smallest u with P(B <= u - 1) >= 1 - tail
    hi_idx = int(np.searchsorted(cdf, 1.0 - tail, side="left")) + 1
    low = float(x[max(lo_idx, 1) - 1])
    high = float(x[min(hi_idx, n) - 1])
    return Quantile(value, min(low, value), max(high, value))


def _binomial_cdf(n: int, p: float) -> NDArray[np.float64]:
    k = np.arange(n + 1, dtype=np.float64)
    if p <= 0.0 or p >= 1.0:
        return np.where(k >= (0 if p <= 0 else n), 1.0, 0.0)
    lg = np.vectorize(math.lgamma)
    log_pmf = lg(n + 1.0) - lg(k + 1.0) - lg(n - k + 1.0) + k * math.log(p)
    log_pmf += (n - k) * math.log1p(-p)
    pmf = np.exp(log_pmf - log_pmf.max())
    cdf = np.cumsum(pmf)
    return np.asarray(cdf / cdf[-1], dtype=np.float64)
