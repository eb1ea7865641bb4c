"""A step's generation with partial rollouts (trainer/partial_schedule.py) through the loop's collect_rollouts, with
the fake segment engine of tests/partial_fakes.py and a fake scorer, no process group: DAPO's dynamic
sampling filters complete groups and draws more generation batches from the pool, GCPO injects into complete
all-wrong groups, and over many steps no prompt is trained twice and every token keeps the staleness bound."""

from types import SimpleNamespace

import pytest
import torch

from mcpo_megatron.algorithms import mastery
from mcpo_megatron.config import load_config
from mcpo_megatron.rollout.placement import LocalRollouts
from mcpo_megatron.trainer import loop, step_data
from mcpo_megatron.trainer.metrics import StepTimer
from mcpo_megatron.trainer.partial_schedule import PartialSchedule

from partial_fakes import FakeEngine, token

W = 4


class Sampler:
    def __init__(self):
        self.drawn = 0

    def next_batch(self):
        out = list(range(self.drawn, self.drawn + W))
        self.drawn += W
        return out


class Setup:
    """collect_rollouts' view of TrainingSetup: the partial schedule over a colocated fake engine; a sample is
    correct when its first token is even, so groups mix right and wrong answers, and some are all wrong."""

    def __init__(self, cfg, long_frac=0.3):
        self.cfg = cfg
        self.sampler = Sampler()
        self.prompt_ids = [[1, 2, 3 + i % 5] for i in range(10_000)]
        self.rollouts = LocalRollouts(FakeEngine(long_frac=long_frac))
        self.schedule = PartialSchedule(self.rollouts, self.sampler, self.prompt_ids, cfg, [0])
        self.references = {f"p{i}": [7, 0] for i in range(10_000)}
        self.tracker = mastery.MasteryTracker()

    def publish(self, version):
        self.rollouts.publish(SimpleNamespace(push=lambda engine: None), version=version)


def fake_score(s, prompt_idx, out, n, version=0):
    correct = [float(x.token_ids[0] % 2 == 0 and x.token_ids[0] != 0) for x in out.samples]
    return step_data.Rollouts(
        group_size=n, uids=[f"p{i}" for i in prompt_idx], prompt_ids=[s.prompt_ids[i] for i in prompt_idx],
        response_ids=out.token_ids, rollout_logp=out.logprobs, finish_reasons=out.finish_reasons,
        scores=torch.tensor([1.0 if c else -1.0 for c in correct], dtype=torch.float64),
        correct=torch.tensor(correct, dtype=torch.float64), statuses=["ok"] * len(out),
        gcpo_injected=torch.zeros(len(out), dtype=torch.bool),
        versions=torch.tensor([min(x.versions) for x in out.samples]),
        token_versions=[list(x.versions) for x in out.samples])


@pytest.fixture(autouse=True)
def scorer(monkeypatch):
    monkeypatch.setattr(step_data, "score", fake_score)


def _cfg(*overrides):
    return load_config(None, ["rollout.n=3", f"data.train_batch_size={W}", "algorithm.mini_batch_size=2",
                              "rollout.max_new_tokens=24", "reward.overlong_buffer.enable=false",
                              "rollout.partial.enable=true", "rollout.partial.spare_groups=2",
                              "rollout.partial.segment_tokens=2", "trainer.max_staleness=1", *overrides])


def _steps(s, steps):
    out = []
    for step in range(steps):
        s.publish(step)
        rollouts, generation = loop.collect_rollouts(s, step, StepTimer())
        out.append((rollouts, generation))
    return out


def _check(runs, max_staleness):
    seen = [u for r, _ in runs for u in r.uids]
    assert len(seen) == len(set(seen)), "a prompt trained twice"
    for step, (r, _) in enumerate(runs):
        for versions in r.token_versions:
            assert step - min(versions) <= max_staleness and max(versions) <= step


def test_dynamic_sampling_filters_complete_groups_and_draws_more_batches():
    s = Setup(_cfg("algorithm.name=dapo", "algorithm.filter_groups.max_gen_batches=6"))
    runs = _steps(s, 8)
    _check(runs, 1)
    for rollouts, generation in runs:
        assert rollouts.num_groups <= W
        stats = mastery.group_stats(rollouts.correct, 3)
        assert not bool((stats.p == 0).any() or (stats.p == 1).any())  # constant groups were filtered
        # every group the step saw was complete: all its responses finished, each with its token versions
        assert all(f in ("stop", "length") for f in generation.seen.finish_reasons)
        assert len(generation.seen.uids) == W * generation.num_batches
    assert any(g.num_batches > 1 for _, g in runs)  # extra generation batches come from the pool too
    assert any(g.filter_counts["dropped_all_wrong"] > 0 for _, g in runs)


def test_gcpo_injects_into_complete_all_wrong_groups():
    refs = "/dev/null"
    s = Setup(_cfg("algorithm.name=gcpo", f"algorithm.gcpo.references={refs}"))
    runs = _steps(s, 6)
    _check(runs, 1)
    injected = 0
    for rollouts, _ in runs:
        for g in range(rollouts.num_groups):
            samples = range(g * 3, (g + 1) * 3)
            flags = [bool(rollouts.gcpo_injected[i]) for i in samples]
            if any(flags):
                injected += 1
                i = g * 3 + flags.index(True)
                assert rollouts.response_ids[i] == [7, 0] and rollouts.correct[i] == 1
                # the reference's tokens count at the version of the response it replaced
                assert rollouts.token_versions[i] == [int(rollouts.versions[i])] * 2
    assert injected > 0


def test_the_batch_a_step_takes_is_its_complete_groups_in_order():
    """Without dynamic sampling a step takes one generation batch of exactly W complete groups, whose responses
    are those the fake engine draws for their seeds (continued over several steps with their history)."""
    s = Setup(_cfg(), long_frac=0.1)
    runs = _steps(s, 6)
    _check(runs, 1)
    for rollouts, generation in runs:
        assert rollouts.num_groups == W and generation.num_batches == 1
        assert generation.batches[0].partial["new_groups"] in (W, W + 2)
        for response in rollouts.response_ids:
            assert all(t == 0 or 1 <= t <= 50 for t in response)
    assert any(len(set(v)) == 2 for r, _ in runs for v in r.token_versions)  # continued over a step boundary
    assert token(1, 0) == token(1, 0)  # the fake's tokens are a function of (seed, position)


def test_switching_partial_rollouts_on_or_off_at_a_resume_loses_no_prompt():
    """A checkpoint without batches in flight can go on with partial rollouts (an empty pool); one with batches in
    flight, or a pool with prompts in it, must be resumed with the setting it was saved with."""
    from mcpo_megatron.trainer.schedule import GenerationSchedule

    s = Setup(_cfg())
    s.schedule.load_state_dict({"in_flight": []})
    assert not s.schedule.pool.groups
    with pytest.raises(ValueError, match="2 generation batches in flight, saved with rollout.partial.enable=false"):
        s.schedule.load_state_dict({"in_flight": [{}, {}]})
    _steps(s, 1)
    pool = s.schedule.state_dict(1)
    assert pool["rollout_pool"]["groups"]  # the spares wait in it
    plain = GenerationSchedule(s.rollouts, s.sampler, s.prompt_ids, load_config(None, []), [0])
    with pytest.raises(ValueError, match="holds a partial-rollout pool"):
        plain.load_state_dict(pool)
