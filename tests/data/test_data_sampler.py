"""PromptSampler: seeded epochs, identical global batches, sharding, exact resume."""

import numpy as np
import pytest

from mcpo_megatron.data import PromptSampler


def test_each_epoch_is_a_permutation_and_epochs_differ():
    s = PromptSampler(10, 3, seed=7)
    epoch0 = [s.next_batch() for _ in range(3)]  # 9 of 10, the tail of 1 is dropped
    flat = [i for b in epoch0 for i in b]
    assert len(set(flat)) == 9 and all(len(b) == 3 for b in epoch0)
    assert s.epoch == 0
    b = s.next_batch()
    assert s.epoch == 1
    epoch1 = [b] + [s.next_batch() for _ in range(2)]
    assert epoch1 != epoch0
    # independent reference: the documented order of epoch e
    ref = np.random.default_rng([7, 1]).permutation(10)
    assert [i for b in epoch1 for i in b] == ref[:9].tolist()


def test_same_seed_same_batches_on_every_rank():
    a, b = PromptSampler(17, 4, seed=3), PromptSampler(17, 4, seed=3)
    assert [a.next_batch() for _ in range(12)] == [b.next_batch() for _ in range(12)]
    c = PromptSampler(17, 4, seed=4)
    assert [PromptSampler(17, 4, seed=3).next_batch() for _ in range(1)] != [c.next_batch()]


def test_no_shuffle_and_keep_last():
    s = PromptSampler(5, 2, seed=0, shuffle=False, drop_last=False)
    assert [s.next_batch() for _ in range(4)] == [[0, 1], [2, 3], [4], [0, 1]]
    assert s.batches_per_epoch == 3


@pytest.mark.parametrize("stop", [0, 1, 2, 5, 7])
def test_resume_draws_what_the_uninterrupted_run_draws(stop):
    full = PromptSampler(11, 4, seed=123)
    expected = [full.next_batch() for _ in range(12)]
    first = PromptSampler(11, 4, seed=123)
    got = [first.next_batch() for _ in range(stop)]
    state = first.state_dict()
    resumed = PromptSampler(11, 4, seed=123)
    resumed.load_state_dict(dict(state))
    got += [resumed.next_batch() for _ in range(12 - stop)]
    assert got == expected
    assert resumed.batches_drawn == 12


def test_load_state_dict_rejects_other_settings():
    state = PromptSampler(11, 4, seed=1).state_dict()
    with pytest.raises(ValueError, match="checkpoint has seed=1 but this sampler has seed=2"):
        PromptSampler(11, 4, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="num_prompts"):
        PromptSampler(12, 4, seed=1).load_state_dict(state)


def test_shard_covers_the_batch_once():
    batch = list(range(10, 21))  # 11 items
    shards = [PromptSampler.shard(batch, r, 4) for r in range(4)]
    assert [len(s) for s in shards] == [3, 3, 3, 2]
    assert [i for s in shards for i in s] == batch
    assert PromptSampler.shard(batch, 0, 1) == batch
    with pytest.raises(ValueError, match="rank=4, world=4"):
        PromptSampler.shard(batch, 4, 4)


def test_bad_sizes():
    with pytest.raises(ValueError, match="batch_size=8 > num_prompts=5"):
        PromptSampler(5, 8, seed=0)
    with pytest.raises(ValueError, match="num_prompts=0"):
        PromptSampler(0, 1, seed=0)
