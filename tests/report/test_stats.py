"""Report intervals against independent references: closed-form Student-t quantiles, t-table values, the
normal approximation of a bootstrap, and the unbiased pass@k by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mcpo_megatron.report import stats


def _t_closed_form(p: float, df: int) -> float:
    """Student-t quantiles with closed forms: df=1 (Cauchy) and df=2."""
    if df == 1:
        return math.tan(math.pi * (p - 0.5))
    if df == 2:
        return (2 * p - 1) / math.sqrt(2 * p * (1 - p))
    raise ValueError(df)


@pytest.mark.parametrize("p,df", [(0.975, 1), (0.975, 2), (0.95, 2), (0.995, 1)])
def test_t_quantile_closed_forms(p, df):
    assert stats.t_quantile(p, df) == pytest.approx(_t_closed_form(p, df), rel=1e-10)


def test_t_interval_three_seeds():
    iv = stats.t_interval([1.0, 2.0, 3.0])
    half = _t_closed_form(0.975, 2) * 1.0 / math.sqrt(3)  # s = 1 (ddof=1)
    assert (iv.mean, iv.n) == (2.0, 3)
    assert iv.half_width == pytest.approx(half, rel=1e-12)
    assert (iv.low, iv.high) == pytest.approx((2.0 - half, 2.0 + half), rel=1e-12)
    assert half == pytest.approx(2.484138, abs=1e-6)


def test_t_interval_two_seeds_and_missing_values():
    # NaN and None (a run that did not log the metric) are left out: two values remain.
    iv = stats.t_interval([0.25, None, float("nan"), 0.75])
    s = math.sqrt(((0.25 - 0.5) ** 2 + (0.75 - 0.5) ** 2) / 1)
    assert iv.n == 2 and iv.mean == 0.5
    assert iv.half_width == pytest.approx(_t_closed_form(0.975, 1) * s / math.sqrt(2), rel=1e-12)
    one = stats.t_interval([0.4])
    assert (one.mean, one.low, one.high, one.n, one.half_width) == (0.4, None, None, 1, None)
    assert stats.t_interval([None, float("nan")]) is None
    with pytest.raises(ValueError, match="confidence"):
        stats.t_interval([1.0, 2.0], confidence=95)


def test_welch_interval_equal_variances_matches_t_table():
    # Equal n and variances: Welch's df is 2(n-1) = 4; t_{0.975,4} = 2.776445105 (t-table).
    iv = stats.welch_interval([2.0, 3.0, 4.0], [1.0, 2.0, 3.0])
    se = math.sqrt(1 / 3 + 1 / 3)
    assert iv.mean == pytest.approx(1.0)
    assert iv.half_width == pytest.approx(2.7764451052 * se, rel=1e-9)
    assert not iv.excludes_zero()
    far = stats.welch_interval([10.0, 10.5, 11.0], [1.0, 1.5, 2.0])
    assert far.excludes_zero() and far.low > 0


def test_welch_interval_unequal_variances_df():
    a, b = [0.0, 2.0, 4.0, 6.0], [1.0, 1.5]
    va, vb = np.var(a, ddof=1) / 4, np.var(b, ddof=1) / 2
    df = (va + vb) ** 2 / (va ** 2 / 3 + vb ** 2 / 1)
    iv = stats.welch_interval(a, b)
    assert iv.mean == pytest.approx(3.0 - 1.25)
    assert iv.half_width == pytest.approx(stats.t_quantile(0.975, df) * math.sqrt(va + vb), rel=1e-12)
    assert stats.welch_interval([1.0], [2.0, 3.0]).half_width is None
    assert stats.welch_interval([], [2.0]) is None
    same = stats.welch_interval([1.0, 1.0], [0.0, 0.0])  # no spread: a zero-width interval, not NaN
    assert (same.low, same.high) == (1.0, 1.0)


def test_bootstrap_interval_matches_normal_approximation():
    x = np.array([1.0] * 200 + [0.0] * 200)
    iv = stats.bootstrap_mean_interval(x, n_boot=4000, seed=1)
    half = 1.959964 * math.sqrt(0.25 / 400)
    assert iv.mean == 0.5 and iv.n == 400
    assert iv.low == pytest.approx(0.5 - half, abs=0.01) and iv.high == pytest.approx(0.5 + half, abs=0.01)
    assert stats.bootstrap_mean_interval(x, n_boot=4000, seed=1) == iv  # seeded
    const = stats.bootstrap_mean_interval([0.25] * 10)
    assert (const.low, const.high) == pytest.approx((0.25, 0.25))
    with pytest.raises(ValueError, match="non-empty"):
        stats.bootstrap_mean_interval([])


def test_per_problem_pass_at_k():
    got = stats.per_problem_pass_at_k([0, 1, 2, 8], 8, 4)
    want = [0.0, 1 - math.comb(7, 4) / math.comb(8, 4), 1 - math.comb(6, 4) / math.comb(8, 4), 1.0]
    assert got.tolist() == pytest.approx(want, rel=1e-12)
    assert stats.per_problem_pass_at_k([3, 1], [4, 2], 1).tolist() == pytest.approx([0.75, 0.5])
