"""Step assembly: rewards -> advantages -> mini-batches -> data-parallel shares with global weights."""

import pytest
import torch

from mcpo_megatron.algorithms import advantages as adv_lib
from mcpo_megatron.algorithms import mastery
from mcpo_megatron.config import load_config
from mcpo_megatron.trainer import step_data


def _rollouts(correct, group_size, lengths=None, prompt_len=3):
    n = len(correct)
    lengths = lengths or [2 + (i % 3) for i in range(n)]
    groups = n // group_size
    return step_data.Rollouts(
        group_size=group_size,
        uids=[f"u{g}" for g in range(groups)],
        prompt_ids=[[100 + g] * prompt_len for g in range(groups)],
        response_ids=[[7] * lengths[i] for i in range(n)],
        rollout_logp=[[-0.5] * lengths[i] for i in range(n)],
        finish_reasons=["stop"] * n,
        scores=torch.tensor([1.0 if c else -1.0 for c in correct], dtype=torch.float64),
        correct=torch.tensor(correct, dtype=torch.float64),
        statuses=["ok"] * n,
        gcpo_injected=torch.zeros(n, dtype=torch.bool),
    )


def _cfg(**overrides):
    items = [f"{k}={v}" for k, v in overrides.items()]
    return load_config(None, ["data.train_batch_size=4", "algorithm.mini_batch_size=2", "rollout.n=4",
                              "reward.overlong_buffer.enable=false", *items])


# 4 groups of 4: mastered, 3/4 correct, 1/4 correct, all wrong.
CORRECT = [1, 1, 1, 1, 1, 1, 1, 0, 1, 0, 0, 0, 0, 0, 0, 0]


def test_estimator_selection_follows_reweight_flag():
    assert step_data.estimator_name(_cfg()) == "mcpo"
    assert step_data.estimator_name(_cfg(**{"algorithm.mcpo.reweight": "false"})) == "grpo"
    assert step_data.estimator_name(_cfg(**{"algorithm.adv_estimator": "drgrpo",
                                            "algorithm.mcpo.reweight": "false"})) == "drgrpo"


def test_advantages_use_verifier_correctness():
    r = _rollouts(CORRECT, 4)
    cfg = _cfg()
    rewards = step_data.shaped_rewards(r, cfg)
    got = step_data.compute_advantages(r, rewards, cfg)
    want = adv_lib.group_advantages(rewards, r.correct, 4, estimator="mcpo")
    torch.testing.assert_close(got, want)
    assert got[:4].abs().max() == 0 and got[12:].abs().max() == 0  # mastered and all-wrong groups: A = 0


def test_overlong_shaping_is_added_to_scores():
    r = _rollouts([1, 0], 2, lengths=[10, 20])
    cfg = _cfg(**{"reward.overlong_buffer.enable": "true", "data.max_response_length": 20,
                  "reward.overlong_buffer.len": 8})
    rewards = step_data.shaped_rewards(r, cfg)
    # L_max 20, cache 8: penalty starts at 12; 10 -> 0, 20 -> -(20 - 12) / 8 = -1
    torch.testing.assert_close(rewards, torch.tensor([1.0, -2.0], dtype=torch.float64))


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                                  "seq-mean-token-sum-norm"])
def test_dp_shares_cover_minibatch_and_weights_are_global(mode):
    r = _rollouts(CORRECT, 4)
    cfg = _cfg(**{"algorithm.loss_agg_mode": mode, "data.max_response_length": 8})
    rewards = step_data.shaped_rewards(r, cfg)
    adv = step_data.compute_advantages(r, rewards, cfg)
    stats = mastery.group_stats(r.correct, 4)
    single = step_data.plan_step(r, adv, rewards, stats.mastered, cfg, dp_rank=0, dp_size=1)
    shares = [step_data.plan_step(r, adv, rewards, stats.mastered, cfg, dp_rank=k, dp_size=2) for k in range(2)]
    assert len(single.minibatches) == 2  # train_batch_size 4 / mini_batch_size 2
    for m in range(2):
        covered = sorted(shares[0].local_samples[m] + shares[1].local_samples[m])
        assert covered == sorted(single.local_samples[m]) == list(range(8 * m, 8 * m + 8))
        totals = {}
        for field in ("pg_weight", "hkl_weight"):
            totals[field] = sum(float(w.sum()) for w in single.minibatches[m].token_fields[field])
            total_split = sum(float(w.sum()) for s in shares for w in s.minibatches[m].token_fields[field])
            assert total_split == pytest.approx(totals[field], rel=1e-6)
        if mode in ("token-mean", "seq-mean-token-mean"):
            assert totals["pg_weight"] == pytest.approx(1.0)  # a mean over the whole mini-batch
    # The hinge weights sum to 1 over the mini-batch that holds the mastered group (Eq. 11), 0 elsewhere.
    hkl = [sum(float(w.sum()) for w in single.minibatches[m].token_fields["hkl_weight"]) for m in range(2)]
    assert hkl == [pytest.approx(1.0), 0.0]


@pytest.mark.parametrize("dp_size", [1, 2, 3, 5, 17])
def test_dp_shares_are_the_samples_plan_step_gives_each_rank(dp_size):
    # what fetch_routing fetches for a rank must be exactly what that rank's plan trains (zero-weight copies too)
    r = _rollouts(CORRECT, 4, lengths=[1 + (7 * i) % 5 for i in range(16)])
    cfg = _cfg(**{"data.max_response_length": 8})
    rewards = step_data.shaped_rewards(r, cfg)
    adv = step_data.compute_advantages(r, rewards, cfg)
    stats = mastery.group_stats(r.correct, 4)
    shares = step_data.dp_shares(r, cfg, dp_size)
    for rank in range(dp_size):
        plan = step_data.plan_step(r, adv, rewards, stats.mastered, cfg, dp_rank=rank, dp_size=dp_size)
        trained = [int(i) for mb in plan.minibatches for i in mb.seq_fields["sample_index"]]
        assert shares[rank] == trained


def test_more_ranks_than_sequences_gets_zero_weight_copy():
    r = _rollouts([1, 0], 2)
    cfg = _cfg(**{"data.train_batch_size": 1, "algorithm.mini_batch_size": 1, "rollout.n": 2})
    rewards = step_data.shaped_rewards(r, cfg)
    adv = step_data.compute_advantages(r, rewards, cfg)
    stats = mastery.group_stats(r.correct, 2)
    plan = step_data.plan_step(r, adv, rewards, stats.mastered, cfg, dp_rank=2, dp_size=3)
    assert plan.local_samples == [[]]
    assert all(float(w.abs().sum()) == 0.0 for w in plan.minibatches[0].token_fields["pg_weight"])


def test_assign_to_ranks_balances_tokens_deterministically():
    lengths = [10, 9, 8, 3, 2, 1]
    shares = step_data.assign_to_ranks(lengths, 2)
    assert shares == step_data.assign_to_ranks(lengths, 2)
    loads = [sum(lengths[i] for i in s) for s in shares]
    assert abs(loads[0] - loads[1]) <= 1
    assert sorted(shares[0] + shares[1]) == list(range(6))


@pytest.mark.parametrize("balance", ["tokens", "flops"])
def test_sequence_packing_balances_ranks_by_karmarkar_karp(balance):
    from mcpo_megatron.models.packing import balanced_partition, sequence_cost

    lengths = [1 + (7 * i) % 5 for i in range(16)]
    r = _rollouts(CORRECT, 4, lengths=lengths)
    cfg = _cfg(**{"data.max_response_length": 8, "trainer.sequence_packing": "true",
                  "trainer.packing_balance": balance})
    rewards = step_data.shaped_rewards(r, cfg)
    adv = step_data.compute_advantages(r, rewards, cfg)
    stats = mastery.group_stats(r.correct, 4)
    shares = step_data.dp_shares(r, cfg, 2)
    for m, groups in enumerate(step_data.minibatch_groups(4, 2)):
        samples = [g * 4 + j for g in groups for j in range(4)]
        costs = [sequence_cost(3 + lengths[s], balance) for s in samples]
        expected = balanced_partition(costs, 2)
        for rank in range(2):
            plan = step_data.plan_step(r, adv, rewards, stats.mastered, cfg, dp_rank=rank, dp_size=2)
            assert plan.local_samples[m] == [samples[i] for i in expected[rank]]
    for rank in range(2):  # what fetch_routing fetches is what the rank trains
        plan = step_data.plan_step(r, adv, rewards, stats.mastered, cfg, dp_rank=rank, dp_size=2)
        assert shares[rank] == [int(i) for mb in plan.minibatches for i in mb.seq_fields["sample_index"]]
    # the weights stay global: the two ranks' shares add up to the unsplit mini-batch's
    single = step_data.plan_step(r, adv, rewards, stats.mastered, cfg, dp_rank=0, dp_size=1)
    split = [step_data.plan_step(r, adv, rewards, stats.mastered, cfg, dp_rank=k, dp_size=2) for k in range(2)]
    for m in range(2):
        total = sum(float(w.sum()) for w in single.minibatches[m].token_fields["pg_weight"])
        assert sum(float(w.sum()) for p in split for w in p.minibatches[m].token_fields["pg_weight"]) == \
            pytest.approx(total, rel=1e-6)


def test_select_and_concat_keep_group_layout():
    r = _rollouts(CORRECT, 4)
    picked = r.select_groups([1, 3])
    assert picked.uids == ["u1", "u3"]
    assert picked.correct.tolist() == CORRECT[4:8] + CORRECT[12:16]
    both = step_data.Rollouts.concat([picked, r.select_groups([0])])
    assert both.num_groups == 3 and both.num_samples == 12
    assert both.correct.tolist() == CORRECT[4:8] + CORRECT[12:16] + CORRECT[0:4]


def test_dynamic_sampling_keeps_mixed_groups():
    keep, counts = step_data.dynamic_sampling_keep(_rollouts(CORRECT, 4))
    assert keep == [1, 2]
    assert sum(counts.values()) >= 2
