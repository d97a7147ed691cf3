"""Confidence intervals for the lab's tables.

* Accuracies of 0/1 outcomes: the Wilson score interval (95% by default), which stays inside
  [0, 1] and is not empty at 0/n or n/n, unlike the normal approximation.
* Means of fractional scores, bits/token and deltas: the percentile bootstrap over the units
  sampled (prompts, passages). bits/token is a ratio of sums (total bits / total scored
  tokens) and is resampled as such. A delta against a baseline is *paired*: each resample
  draws one set of units and evaluates both arms on it, so the spread of the difference
  excludes what the units share. Resamples come from ``numpy.random.default_rng(seed)``: the
  same inputs and seed give the same interval.
"""

from __future__ import annotations

import math
from statistics import NormalDist
from typing import Sequence

import numpy as np

LEVEL = 0.95
N_BOOT = 2000
SEED = 0


def z_value(level: float = LEVEL) -> float:
    """Two-sided standard-normal quantile: 1.95996... for 0.95."""
    return NormalDist().inv_cdf(0.5 + level / 2)


def wilson_interval(successes: int, n: int, level: float = LEVEL) -> tuple:
    """Wilson score interval ``(lo, hi)`` for ``successes`` out of ``n`` 0/1 outcomes."""
    if n < 1 or not 0 <= successes <= n:
        raise ValueError(f"need 0 <= successes <= n and n >= 1, got {successes}/{n}")
    z = z_value(level)
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    # at 0/n and n/n one bound is exactly 0 or 1; rounding would leave it a few ulps off
    lo = 0.0 if successes == 0 else max(0.0, centre - half)
    hi = 1.0 if successes == n else min(1.0, centre + half)
    return lo, hi


def bootstrap_indices(n: int, n_boot: int = N_BOOT, seed: int = SEED) -> np.ndarray:
    """``[n_boot, n]`` indices drawn with replacement from ``0..n-1``."""
    return np.random.default_rng(seed).integers(0, n, size=(n_boot, n))


def _percentiles(stats: np.ndarray, level: float) -> tuple:
    lo, hi = np.quantile(stats, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def ratio_interval(num: Sequence[float], den: Sequence[float], level: float = LEVEL,
                   n_boot: int = N_BOOT, seed: int = SEED) -> tuple:
    """Bootstrap interval of ``sum(num) / sum(den)`` over units ``[n]`` (e.g. bits and
    scored tokens per passage)."""
    num, den = np.asarray(num, dtype=np.float64), np.asarray(den, dtype=np.float64)
    idx = bootstrap_indices(len(num), n_boot, seed)  # [n_boot, n]
    return _percentiles(num[idx].sum(1) / den[idx].sum(1), level)


def mean_interval(values: Sequence[float], level: float = LEVEL, n_boot: int = N_BOOT,
                  seed: int = SEED) -> tuple:
    """Bootstrap interval of the mean of ``values [n]``."""
    return ratio_interval(values, np.ones(len(values)), level, n_boot, seed)


def paired_delta_interval(num_a: Sequence[float], den_a: Sequence[float], num_b: Sequence[float],
                          den_b: Sequence[float], level: float = LEVEL, n_boot: int = N_BOOT,
                          seed: int = SEED) -> tuple:
    """Paired bootstrap interval of ``sum(num_b)/sum(den_b) - sum(num_a)/sum(den_a)``: unit i
    of arm a and unit i of arm b are the same prompt or passage, resampled together."""
    a_n, a_d = np.asarray(num_a, dtype=np.float64), np.asarray(den_a, dtype=np.float64)
    b_n, b_d = np.asarray(num_b, dtype=np.float64), np.asarray(den_b, dtype=np.float64)
    if not len(a_n) == len(a_d) == len(b_n) == len(b_d):
        raise ValueError("paired arms need the same units")
    idx = bootstrap_indices(len(a_n), n_boot, seed)  # [n_boot, n], shared by both arms
    delta = b_n[idx].sum(1) / b_d[idx].sum(1) - a_n[idx].sum(1) / a_d[idx].sum(1)
    return _percentiles(delta, level)


def score_interval(scores: Sequence[float], level: float = LEVEL, seed: int = SEED) -> tuple:
    """``(lo, hi, method)`` for the mean of per-prompt scores in [0, 1]: Wilson when every
    score is 0 or 1, else the bootstrap of the mean (fractional scores, e.g. RULER's
    string_match_all over several needles)."""
    if all(s in (0, 1) for s in scores):
        lo, hi = wilson_interval(int(sum(scores)), len(scores), level)
        return lo, hi, "wilson"
    lo, hi = mean_interval(scores, level, seed=seed)
    return lo, hi, "bootstrap"
