"""Uncertainty for reports: Student-t intervals over seeds, Welch intervals of a difference of means, and
percentile-bootstrap intervals over benchmark problems.

Seeds are the replicates of an experiment: a run's metric (final accuracy, mean mastered fraction, pass@1) is
one observation, and the interval over ``n`` seeds is ``mean +- t_{(1+c)/2, n-1} * s / sqrt(n)`` with ``s`` the
sample standard deviation (ddof=1). It assumes the per-seed values are independent and roughly normal; with 3
seeds ``t_{0.975, 2} = 4.30``, so the interval is wide by construction, as it should be.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np


@dataclass(frozen=True)
class Interval:
    """A mean (or a difference of means) with a two-sided interval; ``low``/``high`` are None when ``n < 2``."""

    mean: float
    low: Optional[float]
    high: Optional[float]
    n: int
    confidence: float = 0.95

    @property
    def half_width(self) -> Optional[float]:
        return None if self.low is None or self.high is None else (self.high - self.low) / 2

    def excludes_zero(self) -> bool:
        return self.low is not None and self.high is not None and (self.low > 0 or self.high < 0)


def _finite(values: Sequence[Optional[float]]) -> np.ndarray:
    x = np.asarray([v for v in values if v is not None], dtype=np.float64)
    return x[np.isfinite(x)]


def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom."""
    from scipy import stats

    return float(stats.t.ppf(p, df))


def t_interval(values: Sequence[Optional[float]], confidence: float = 0.95) -> Optional[Interval]:
    """Mean and Student-t interval over the finite values (None and NaN are left out); None when none is left."""
    _check_confidence(confidence)
    x = _finite(values)
    if x.size == 0:
        return None
    mean = float(x.mean())
    if x.size < 2:
        return Interval(mean, None, None, int(x.size), confidence)
    half = t_quantile((1 + confidence) / 2, x.size - 1) * float(x.std(ddof=1)) / math.sqrt(x.size)
    return Interval(mean, mean - half, mean + half, int(x.size), confidence)


def welch_interval(a: Sequence[Optional[float]], b: Sequence[Optional[float]],
                   confidence: float = 0.95) -> Optional[Interval]:
    """``mean(a) - mean(b)`` with Welch's t interval (unequal variances, Welch-Satterthwaite degrees of
    freedom); no interval when either side has fewer than 2 values, None when either side is empty.
    ``n`` is the smaller sample size."""
    _check_confidence(confidence)
    x, y = _finite(a), _finite(b)
    if x.size == 0 or y.size == 0:
        return None
    diff = float(x.mean() - y.mean())
    n = int(min(x.size, y.size))
    if x.size < 2 or y.size < 2:
        return Interval(diff, None, None, n, confidence)
    vx, vy = float(x.var(ddof=1)) / x.size, float(y.var(ddof=1)) / y.size
    se = math.sqrt(vx + vy)
    if se == 0.0:
        return Interval(diff, diff, diff, n, confidence)
    df = (vx + vy) ** 2 / (vx ** 2 / (x.size - 1) + vy ** 2 / (y.size - 1))
    half = t_quantile((1 + confidence) / 2, df) * se
    return Interval(diff, diff - half, diff + half, n, confidence)


def bootstrap_mean_interval(per_problem: Sequence[float], *, confidence: float = 0.95, n_boot: int = 2000,
                            seed: int = 0) -> Interval:
    """Mean over problems with a percentile-bootstrap interval: resample the problems with replacement
    ``n_boot`` times (seeded: the same problems give the same interval)."""
    _check_confidence(confidence)
    x = np.asarray(per_problem, dtype=np.float64)
    if x.ndim != 1 or x.size == 0:
        raise ValueError(f"per_problem must be a non-empty list of numbers, got shape {x.shape}")
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, x.size, size=(n_boot, x.size))].mean(axis=1)
    alpha = (1 - confidence) / 2
    low, high = np.quantile(means, [alpha, 1 - alpha])
    return Interval(float(x.mean()), float(low), float(high), int(x.size), confidence)


def per_problem_pass_at_k(correct: Sequence[int], n: Sequence[int] | int, k: int) -> np.ndarray:
    """Per-problem unbiased pass@k ``1 - C(n-c, k) / C(n, k)`` (k=1: c/n), from correct counts ``c``."""
    from mcpo_megatron.algorithms.metrics import pass_at_k

    ns = [n] * len(correct) if isinstance(n, int) else list(n)
    return np.asarray([pass_at_k(int(ni), int(c), k) for ni, c in zip(ns, correct)], dtype=np.float64)


def _check_confidence(confidence: float) -> None:
    if not 0 < confidence < 1:
        raise ValueError(f"confidence={confidence}: must be strictly between 0 and 1, e.g. 0.95")
