"""Overlong shaping, dynamic sampling, GCPO injection, pass@k / bootstrap best@k, mastery tracker."""

import json
import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from mcpo_megatron.algorithms import (
    MasteryTracker,
    bootstrap_best_at_k,
    dynamic_sampling_filter,
    expected_best_at_k,
    group_advantages,
    group_stats,
    inject_reference,
    kept_sequence_indices,
    overlong_penalty,
    pass_at_k,
)

F64 = torch.float64


# ---------------------------------------------------------------- overlong shaping (docs/algorithms.md §9)


def test_overlong_penalty_documented_values():
    lengths = torch.tensor([0, 1000, 16384, 17408, 18432, 20480])
    pen = overlong_penalty(lengths, 20480, 4096, 1.0)
    assert pen.tolist() == [0.0, 0.0, 0.0, -0.25, -0.5, -1.0]
    assert overlong_penalty(torch.tensor([18432]), 20480, 4096, 0.5).tolist() == [-0.25]
    # against the formula written out
    for n in (16385, 19000, 20479):
        assert overlong_penalty(torch.tensor([n]), 20480, 4096, 1.0).item() == pytest.approx(-(n - 16384) / 4096)


def test_overlong_penalty_rejects_bad_config():
    with pytest.raises(ValueError, match="cache_len=0"):
        overlong_penalty(torch.tensor([1]), 20480, 0, 1.0)
    with pytest.raises(ValueError, match="cache_len=30000"):
        overlong_penalty(torch.tensor([1]), 20480, 30000, 1.0)
    with pytest.raises(ValueError, match="lengths"):
        overlong_penalty(torch.tensor([-1]), 20480, 4096, 1.0)


# ---------------------------------------------------------------- dynamic sampling


def test_dynamic_sampling_filter_counts_and_indices():
    acc = torch.tensor([1, 1, 1, 1, 0, 0, 0, 0, 1, 0, 1, 1, 0, 1, 0, 0])
    keep, counts = dynamic_sampling_filter(acc, 4)
    assert keep.tolist() == [False, False, True, True]
    assert counts == {"groups": 4, "kept": 2, "dropped": 2, "dropped_all_correct": 1, "dropped_all_wrong": 1,
                      "dropped_other": 0}
    assert kept_sequence_indices(keep, 4).tolist() == list(range(8, 16))


def test_dynamic_sampling_on_a_shaped_metric():
    # scores constant in group 1 although acc is mixed (impossible for +-1 scores, possible for other metrics)
    score = torch.tensor([0.5, 0.5, 1.0, -1.0, -0.5, -0.5])
    acc = torch.tensor([1, 0, 1, 0, 0, 0])
    keep, counts = dynamic_sampling_filter(score, 2, correct=acc)
    assert keep.tolist() == [False, True, False]
    assert counts["dropped_other"] == 1 and counts["dropped_all_wrong"] == 1 and counts["dropped_all_correct"] == 0


def test_dynamic_sampling_keeps_singletons_like_verl():
    keep, counts = dynamic_sampling_filter(torch.tensor([1, 0, 1]), 1)
    assert keep.tolist() == [True, True, True] and counts["dropped"] == 0


# ---------------------------------------------------------------- GCPO (docs/algorithms.md §10)


def test_gcpo_injection_k1_numbers_and_mcpo_interaction():
    g = 16
    rewards = torch.zeros(2 * g, dtype=F64)  # 0/1 acc as reward, as in the documented values
    rewards[g:g + 5] = 1.0  # group 1 is not all wrong
    correct = rewards.clone()
    responses = [[7, i, 2] for i in range(2 * g)]
    refs = [[9, 9, 2], [8, 2]]
    before = (rewards.clone(), correct.clone(), list(responses))
    inj = inject_reference(rewards, correct, g, responses, refs, max_len=10, eos_token_id=2)
    assert torch.equal(rewards, before[0]) and torch.equal(correct, before[1]) and responses == before[2]
    assert inj.replaced == [0] and inj.groups == [0]
    assert inj.responses[0] == [9, 9, 2] and inj.responses[1:] == responses[1:]
    assert inj.counts == {"all_wrong_groups": 1, "injected": 1, "skipped_missing": 0, "skipped_too_long": 0,
                          "skipped_no_eos": 0}
    a = group_advantages(inj.rewards, inj.correct, g, estimator="grpo")
    assert a[0].item() == pytest.approx(3.749985, abs=1.5e-6)
    assert a[1:g].tolist() == pytest.approx([-0.249999] * (g - 1), abs=1.5e-6)
    # GCPO + MCPO: p = 1/G -> scale 1, not mastered (no hinge)
    stats = group_stats(inj.correct, g)
    assert stats.p[0].item() == 1 / g and not bool(stats.mastered[0])
    assert torch.equal(group_advantages(inj.rewards, inj.correct, g, estimator="mcpo"), a)


def test_gcpo_replaces_the_lowest_reward_and_skips_bad_references():
    rewards = torch.tensor([-1.0, -1.5, -1.2, -1.5, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1, -1, -1, -1])
    correct = torch.zeros(16)
    responses = [[1, 2]] * 16
    refs = [[5, 0], None, [5] * 11 + [0], [5, 5, 3]]
    inj = inject_reference(rewards, correct, 4, responses, refs, max_len=10, eos_token_id=0,
                           reference_reward=0.75)
    assert inj.replaced == [1]  # lowest reward, first on ties
    assert inj.rewards[1].item() == 0.75 and inj.correct[1].item() == 1.0
    assert inj.counts == {"all_wrong_groups": 4, "injected": 1, "skipped_missing": 1, "skipped_too_long": 1,
                          "skipped_no_eos": 1}
    with pytest.raises(ValueError, match="references: 3 entries for 4 groups"):
        inject_reference(rewards, correct, 4, responses, refs[:3], max_len=10)


# ---------------------------------------------------------------- pass@k and bootstrap best@k (docs/algorithms.md §12)


def _pass_at_k_exact(n, c, k):
    return float(1 - Fraction(math.comb(n - c, k), math.comb(n, k)))


@pytest.mark.parametrize("n, c, k", [(8, 1, 1), (8, 1, 8), (8, 3, 4), (16, 0, 4), (16, 16, 1), (10, 7, 5),
                                     (1000, 3, 100), (200, 50, 32)])
def test_pass_at_k_matches_exact_binomials(n, c, k):
    assert pass_at_k(n, c, k) == pytest.approx(_pass_at_k_exact(n, c, k), rel=1e-12, abs=1e-15)


def test_pass_at_k_edge_cases_and_errors():
    assert pass_at_k(8, 0, 8) == 0.0 and pass_at_k(8, 1, 8) == 1.0 and pass_at_k(8, 2, 1) == 0.25
    with pytest.raises(ValueError, match="k=9"):
        pass_at_k(8, 1, 9)
    with pytest.raises(ValueError, match="c=9"):
        pass_at_k(8, 9, 1)


def _verl_style_bootstrap(row, k, n_boot, seed):
    """verl's bootstrap_metric(...)[best] for one problem, with the global NumPy generator."""
    state = np.random.get_state()
    try:
        np.random.seed(seed)
        vals = []
        for _ in range(n_boot):
            idx = np.random.choice(len(row), size=k, replace=True)
            vals.append(np.max([row[i] for i in idx]))
        return float(np.mean(vals))
    finally:
        np.random.set_state(state)


def test_bootstrap_best_at_k_reproduces_verl_draws():
    rng = np.random.RandomState(3)
    m = (rng.rand(5, 8) < 0.3).astype(float)
    expected = np.mean([_verl_style_bootstrap(list(row), 8, 1000, 42) for row in m])
    assert bootstrap_best_at_k(m, 8) == pytest.approx(expected, rel=1e-15)
    assert bootstrap_best_at_k(m, 4, n_boot=300, seed=1) == pytest.approx(
        np.mean([_verl_style_bootstrap(list(row), 4, 300, 1) for row in m]), rel=1e-15)


def test_bootstrap_one_of_eight_scores_0656():
    # docs/algorithms.md §12: a problem with 1/8 correct scores 0.656 at k = 8 (vs true pass@8 = 1)
    assert round(expected_best_at_k(8, 1, 8), 3) == 0.656
    per_position = [bootstrap_best_at_k([[1.0 if j == i else 0.0 for j in range(8)]], 8) for i in range(8)]
    assert all(abs(v - 0.656) < 0.03 for v in per_position)  # 1000 draws: std about 0.015
    assert np.mean(per_position) == pytest.approx(0.656, abs=0.005)
    assert bootstrap_best_at_k([[1] + [0] * 7], 8, n_boot=100_000) == pytest.approx(0.656, abs=0.003)
    assert pass_at_k(8, 1, 8) == 1.0


# ---------------------------------------------------------------- mastery tracker


def test_mastery_tracker_retention_and_state_dict():
    tr = MasteryTracker()
    tr.update(["a", "b", "c"], torch.tensor([1.0, 0.5, 1.0]), torch.tensor([True, False, True]), step=1)
    assert sorted(tr.mastered_at(1)) == ["a", "c"] and tr.mastered_at(2) == []
    assert tr.previously_mastered(["c", "b", "z"]).tolist() == [True, False, False]
    ret, n = tr.retention(["a", "b", "c"], torch.tensor([0.75, 1.0, 1.0]))
    assert n == 2 and ret == pytest.approx(0.875)
    assert math.isnan(tr.retention(["b"], torch.tensor([1.0]))[0])
    state = json.loads(json.dumps(tr.state_dict()))
    tr2 = MasteryTracker()
    tr2.load_state_dict(state)
    assert tr2.get("a") == (1.0, True, 1, 1) and len(tr2) == 3  # synchronous: generated by version = step
    tr2.update(["a"], [0.5], [False], step=2)
    assert tr2.previously_mastered(["a"]).tolist() == [False] and tr.get("a")[1]
    with pytest.raises(ValueError, match="one of each per group"):
        tr.update(["a", "b"], [1.0], [True], step=3)
    with pytest.raises(ValueError, match="one of each per group"):
        tr.update(["a", "b"], [1.0, 0.5], [True, False], step=3, versions=[2])


def test_mastery_tracker_records_the_generating_policy_version():
    """Asynchronous training (docs/algorithms.md §13): a group's p is that of the policy version that generated it,
    kept next to the step that trained on it; checkpoints of synchronous runs (no versions) still load."""
    tr = MasteryTracker()
    tr.update(["a", "b"], [1.0, 0.25], [True, False], step=5, versions=[4, 3])
    assert tr.get("a") == (1.0, True, 5, 4) and tr.get("b") == (0.25, False, 5, 3)
    assert tr.mastered_at(5) == ["a"]
    tr2 = MasteryTracker()
    tr2.load_state_dict(json.loads(json.dumps(tr.state_dict())))
    assert tr2.get("b") == (0.25, False, 5, 3)
    old = MasteryTracker()
    old.load_state_dict({"version": 1, "last": {"a": [1.0, True, 7]}})
    assert old.get("a") == (1.0, True, 7, 7)
    with pytest.raises(ValueError, match="expected 1 or 2"):
        old.load_state_dict({"version": 3, "last": {}})
