"""Advantages and mastery statistics: the test vectors and edge cases of docs/algorithms.md §3
(float64)."""

import math

import pytest
import torch

from mcpo_megatron.algorithms import (
    group_advantages,
    group_stats,
    mcpo_scale,
    overlong_penalty,
    query_weight,
    sequence_mastered,
)

from algo_reference import reference_advantages

F64 = torch.float64
G = 16

# docs/algorithms.md §3 table (rewards are the 0/1 acc): k -> (grpo unbiased, mcpo unbiased, mcpo population),
# each (A of a correct response, A of an incorrect one)
TABLE = {
    1: ((3.749985, -0.249999), (3.749985, -0.249999), (3.872967, -0.258198)),
    8: ((0.968244, -0.968244), (0.968244, -0.968244), (0.999998, -0.999998)),
    9: ((0.853911, -1.097885), (0.860661, -1.106565), (0.888887, -1.142855)),
    12: ((0.559016, -1.677047), (0.645496, -1.936487), (0.666665, -1.999995)),
    14: ((0.365961, -2.561730), (0.553282, -3.872972), (0.571427, -3.999988)),
    15: ((0.249999, -3.749985), (0.516396, -7.745936), (0.533331, -7.999967)),
}


def _group(k):
    c = torch.tensor([1.0] * k + [0.0] * (G - k), dtype=F64)
    return c.clone(), c


@pytest.mark.parametrize("k", sorted(TABLE))
def test_documented_table(k):
    rewards, correct = _group(k)
    cols = [("grpo", "unbiased"), ("mcpo", "unbiased"), ("mcpo", "population")]
    for (estimator, std_mode), (a_pos, a_neg) in zip(cols, TABLE[k]):
        a = group_advantages(rewards, correct, G, estimator=estimator, std_mode=std_mode)
        assert a.dtype == F64
        assert a[0].item() == pytest.approx(a_pos, abs=1.5e-6), (estimator, std_mode)
        assert a[-1].item() == pytest.approx(a_neg, abs=1.5e-6), (estimator, std_mode)
        ref = reference_advantages(rewards.tolist(), correct.tolist(), G, estimator=estimator, std_mode=std_mode)
        assert torch.allclose(a, torch.tensor(ref, dtype=F64), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("k", [0, G])
@pytest.mark.parametrize("estimator", ["grpo", "drgrpo", "mcpo"])
def test_constant_groups_give_exact_zeros(k, estimator):
    rewards, correct = _group(k)
    a = group_advantages(rewards * 0.1 + 0.3, correct, G, estimator=estimator)  # inexact float mean
    assert torch.count_nonzero(a) == 0


def test_scale_of_15_16_and_the_threshold():
    assert mcpo_scale(torch.tensor(15 / 16)).item() == pytest.approx(0.484123, abs=1e-6)
    assert mcpo_scale(torch.tensor([0.5, 1.0, 0.0, 0.25])).tolist() == [1.0, 1.0, 1.0, 1.0]
    assert mcpo_scale(torch.tensor(0.75)).item() == pytest.approx(2 * math.sqrt(0.75 * 0.25), rel=1e-15)
    assert mcpo_scale(torch.tensor(0.6), threshold=0.7).item() == 1.0


def test_mastered_group_with_overlong_response_keeps_baseline_advantages():
    # docs/algorithms.md §3: all 16 correct, one at 18432 tokens (penalty -0.5): A = +0.25 / -3.75; p = 1 keeps scale 1
    lengths = torch.tensor([1000] * 15 + [18432])
    pen = overlong_penalty(lengths, 20480, 4096, 1.0)
    rewards = torch.ones(G, dtype=F64) + pen
    correct = torch.ones(G, dtype=F64)
    for estimator in ("grpo", "mcpo"):
        a = group_advantages(rewards, correct, G, estimator=estimator)
        assert a[0].item() == pytest.approx(0.25, rel=1e-5)
        assert a[-1].item() == pytest.approx(-3.75, rel=1e-5)
    assert torch.equal(group_advantages(rewards, correct, G, estimator="grpo"),
                       group_advantages(rewards, correct, G, estimator="mcpo"))


def test_p_comes_from_correct_not_from_the_shaped_reward():
    # rewards say 3/4 "good" but acc says 1/4 correct: MCPO must not reweight (p = 1/4 <= 0.5)
    rewards = torch.tensor([1.0, 1.0, 1.0, -1.0], dtype=F64)
    correct = torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=F64)
    assert torch.equal(group_advantages(rewards, correct, 4, estimator="mcpo"),
                       group_advantages(rewards, correct, 4, estimator="grpo"))
    with pytest.raises(ValueError, match="binary acc"):
        group_advantages(rewards, rewards * 0.5, 4, estimator="mcpo")


def test_several_groups_match_the_reference_and_the_std_modes():
    torch.manual_seed(0)
    g, n = 8, 12
    correct = (torch.rand(n * g) < torch.rand(n).repeat_interleave(g)).to(F64)
    rewards = 2 * correct - 1 + overlong_penalty(torch.randint(0, 20480, (n * g,)), 20480, 4096, 1.0)
    for estimator in ("grpo", "drgrpo", "mcpo"):
        for std_mode in ("unbiased", "population"):
            a = group_advantages(rewards, correct, g, estimator=estimator, std_mode=std_mode)
            ref = reference_advantages(rewards.tolist(), correct.tolist(), g, estimator=estimator, std_mode=std_mode)
            assert torch.allclose(a, torch.tensor(ref, dtype=F64), rtol=1e-12, atol=1e-12), (estimator, std_mode)


def test_unbiased_std_rescales_by_sqrt_15_16():
    rewards, correct = _group(5)
    unb = group_advantages(rewards, correct, G, estimator="grpo", std_mode="unbiased", eps=0.0)
    pop = group_advantages(rewards, correct, G, estimator="grpo", std_mode="population", eps=0.0)
    assert torch.allclose(unb / pop, torch.full_like(unb, math.sqrt(15 / 16)), rtol=1e-13)


def test_singleton_groups_get_zero():
    a = group_advantages(torch.tensor([1.0, -1.0, 0.5]), torch.tensor([1, 0, 1]), 1, estimator="grpo")
    assert a.tolist() == [0.0, 0.0, 0.0] and a.dtype == torch.float32


def test_empty_responses_count_in_p():
    # 3 of 4 correct; the empty response (wrong, penalised like any other) still counts in p = 3/4
    rewards = torch.tensor([1.0, 1.0, 1.0, -1.0], dtype=F64)
    correct = torch.tensor([1.0, 1.0, 1.0, 0.0], dtype=F64)
    stats = group_stats(correct, 4)
    assert stats.p.tolist() == [0.75]
    a = group_advantages(rewards, correct, 4, estimator="mcpo", eps=0.0)
    grpo = group_advantages(rewards, correct, 4, estimator="grpo", eps=0.0)
    assert torch.allclose(a, grpo / (2 * math.sqrt(0.75 * 0.25)), rtol=1e-14)


def test_drgrpo_has_no_std_normalisation():
    rewards, correct = _group(12)
    a = group_advantages(rewards, correct, G, estimator="drgrpo")
    assert a[0].item() == pytest.approx(0.25, rel=1e-15) and a[-1].item() == pytest.approx(-0.75, rel=1e-15)


def test_bad_inputs_are_rejected_with_clear_messages():
    r = torch.zeros(6)
    with pytest.raises(ValueError, match="multiple of group_size=4"):
        group_advantages(r, r, 4, estimator="grpo")
    with pytest.raises(ValueError, match="estimator='ppo'"):
        group_advantages(r, r, 3, estimator="ppo")
    with pytest.raises(ValueError, match="std_mode"):
        group_advantages(r, r, 3, estimator="grpo", std_mode="biased")
    with pytest.raises(ValueError, match=r"rewards\[1\]=nan"):
        group_advantages(torch.tensor([0.0, float("nan"), 1.0]), torch.zeros(3), 3, estimator="grpo")
    with pytest.raises(ValueError, match="1-D"):
        group_advantages(torch.zeros(2, 3), torch.zeros(2, 3), 3, estimator="grpo")


# ---------------------------------------------------------------- mastery statistics and W(x)


def test_group_stats_classification():
    correct = torch.tensor([1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 1, 0, 0, 0])
    s = group_stats(correct, 4)
    assert s.p.tolist() == [1.0, 0.75, 0.0, 0.25]
    assert s.mastered.tolist() == [True, False, False, False]
    assert s.majority_correct.tolist() == [False, True, False, False]
    assert s.all_wrong.tolist() == [False, False, True, False]
    assert sequence_mastered(correct, 4).tolist() == [True] * 4 + [False] * 12
    # a singleton group is never mastered (G_eff >= 2)
    assert group_stats(torch.tensor([1, 1]), 1).mastered.tolist() == [False, False]


@pytest.mark.parametrize("std_mode", ["unbiased", "population"])
@pytest.mark.parametrize("estimator", ["grpo", "mcpo", "drgrpo"])
def test_query_weight_equals_mean_advantage_of_correct_responses(std_mode, estimator):
    # W(x) = (1/G) sum of the advantages of correct responses with 0/1 rewards (eps = 0)
    for k in range(G + 1):
        rewards, correct = _group(k)
        a = group_advantages(rewards, correct, G, estimator=estimator, std_mode=std_mode, eps=0.0)
        w = query_weight(torch.tensor(k / G), G, estimator=estimator, std_mode=std_mode)
        assert w.item() == pytest.approx(float(a[:k].sum()) / G, rel=1e-12, abs=1e-15), k


def test_query_weight_documented_values():
    p = torch.tensor([9 / 16, 12 / 16, 15 / 16])
    # MCPO fixes W = 0.5 (population) or 0.5 sqrt(15/16) = 0.4841 (unbiased) for p > 0.5
    assert torch.allclose(query_weight(p, G, estimator="mcpo", std_mode="population"), torch.full((3,), 0.5, dtype=F64))
    assert query_weight(p, G, estimator="mcpo").tolist()[0] == pytest.approx(0.4841, abs=1e-4)
    grpo = query_weight(p, G, estimator="grpo", std_mode="population")
    assert torch.allclose(grpo, torch.sqrt(p * (1 - p)).to(F64))
    assert torch.allclose(query_weight(p, G, estimator="drgrpo"), (p * (1 - p)).to(F64))
    assert query_weight(torch.tensor([0.0, 1.0]), G, estimator="mcpo").tolist() == [0.0, 0.0]


def test_all_wrong_group_is_nonzero_only_through_length_shaping():
    correct = torch.zeros(4, dtype=F64)
    score = -torch.ones(4, dtype=F64)
    assert torch.count_nonzero(group_advantages(score, correct, 4, estimator="mcpo")) == 0
    shaped = score + overlong_penalty(torch.tensor([100, 17408, 18432, 100]), 20480, 4096, 1.0)
    a = group_advantages(shaped, correct, 4, estimator="mcpo")
    ref = reference_advantages(shaped.tolist(), correct.tolist(), 4, estimator="grpo")
    assert torch.allclose(a, torch.tensor(ref, dtype=F64), rtol=1e-13)  # p = 0: no reweighting
    assert a[0] > 0 and a[2] < a[1] < 0
