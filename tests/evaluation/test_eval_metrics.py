"""Evaluation metrics on fixed responses, checked against independent float64 references."""

import math

import numpy as np
import pytest

from mcpo_megatron.evaluation import BenchmarkResult, benchmark_result, score_samples
from mcpo_megatron.rewards import MathVerifyScorer


def unbiased_reference(n, c, k):
    """pass@k = 1 - C(n-c, k) / C(n, k) with exact integer binomials."""
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


# 3 problems x 4 samples of fixed responses; correctness written by hand
GOLDS = ["12", "\\frac{1}{2}", "7"]
RESPONSES = [
    ["So 12.\nAnswer: 12", "Answer: 13", "Answer: 12", "no idea"],
    ["Answer: 0.5", "Answer: \\frac{1}{2}", "Answer: 2", "Answer: 1/2"],
    ["Answer: 8", "Answer: 9", "", "Answer: 6"],
]
HAND_CORRECT = [[1, 0, 1, 0], [1, 1, 0, 1], [0, 0, 0, 0]]


@pytest.fixture(scope="module")
def result():
    with MathVerifyScorer(num_workers=1, timeout_s=5.0) as scorer:
        return score_samples(
            "toy", GOLDS, RESPONSES, scorer=scorer, k=2,
            truncated=[[False, False, True, False], [False] * 4, [True, False, False, False]],
            uids=["p0", "p1", "p2"],
        )


def test_pass_at_1_is_the_mean_over_samples(result):
    assert result.pass_at_1 == pytest.approx(np.mean(HAND_CORRECT))
    assert [p["correct"] for p in result.per_problem] == [sum(r) for r in HAND_CORRECT]
    assert [p["uid"] for p in result.per_problem] == ["p0", "p1", "p2"]
    assert (result.num_problems, result.samples_per_problem, result.k) == (3, 4, 2)


def test_unbiased_pass_at_k_matches_exact_binomials(result):
    expected = np.mean([unbiased_reference(4, sum(r), 2) for r in HAND_CORRECT])
    assert result.pass_at_k == pytest.approx(expected, abs=1e-12)


def test_bootstrap_pass_at_k_is_near_its_expectation(result):
    # E[best of k draws with replacement] = 1 - (1 - c/n)^k; 1000 draws -> standard error < 0.016
    expected = np.mean([1 - (1 - sum(r) / 4) ** 2 for r in HAND_CORRECT])
    assert result.bootstrap_pass_at_k == pytest.approx(expected, abs=0.05)


def test_lengths_truncation_and_statuses(result):
    flat = [r for row in RESPONSES for r in row]
    assert result.length_unit == "chars"
    assert result.mean_response_length == pytest.approx(np.mean([len(r) for r in flat]))
    assert result.truncation_rate == pytest.approx(2 / 12)
    assert sum(result.status_counts.values()) == 12
    assert result.status_counts["no_answer"] >= 2  # "no idea" and ""


def test_summary_keys(result):
    s = result.summary()
    assert s["pass@1"] == result.pass_at_1 and s["pass@2"] == result.pass_at_k
    assert s["bootstrap_pass@2"] == result.bootstrap_pass_at_k
    assert sum(s[f"status/{x}"] for x in ("ok", "no_answer", "timeout", "crashed")) == pytest.approx(1.0)
    assert BenchmarkResult.from_dict(result.to_dict()) == result


def test_paper_grid_and_extremes():
    # 30 problems x 8 samples: pass@1 lies on the 1/240 grid, pass@8 unbiased on the 1/30 grid
    rng = np.random.default_rng(0)
    m = (rng.random((30, 8)) < 0.4).astype(int)
    r = benchmark_result("aime_2024", m, lengths=np.full((30, 8), 100.0))
    assert r.pass_at_1 * 240 == pytest.approx(round(r.pass_at_1 * 240))
    solved = (m.sum(1) > 0).mean()
    assert r.pass_at_k == pytest.approx(solved)  # k = n: pass@n is "any sample correct"
    assert r.mean_response_length == 100.0
    # one correct of 8: the bootstrap underestimates (spec: 0.656 vs the unbiased 1.0)
    one = benchmark_result("x", [[1, 0, 0, 0, 0, 0, 0, 0]])
    assert one.pass_at_k == 1.0
    assert one.bootstrap_pass_at_k == pytest.approx(1 - (7 / 8) ** 8, abs=0.05)
    allc = benchmark_result("x", [[1] * 8, [0] * 8])
    assert (allc.pass_at_1, allc.pass_at_k, allc.bootstrap_pass_at_k) == (0.5, 0.5, 0.5)


def test_bad_inputs():
    with pytest.raises(ValueError, match="same number of samples"):
        benchmark_result("x", [[1, 0], [1]])
    with pytest.raises(ValueError, match="k=5 must be in \\[1, n=2\\]"):
        benchmark_result("x", [[1, 0]], k=5)
    with pytest.raises(ValueError, match="only 0/1"):
        benchmark_result("x", [[2, 0]])
    with pytest.raises(ValueError, match="lengths must be"):
        benchmark_result("x", [[1, 0]], lengths=[[1]])
