"""Generation batches of a step (seeds, dynamic sampling's partial batch) and the step record, with fakes for the
engine and the scorer (no process group)."""

from types import SimpleNamespace

import pytest
import torch

from mcpo_megatron.algorithms import mastery
from mcpo_megatron.config import load_config
from mcpo_megatron.rollout.engines.interface import RolloutOutput, RolloutSample
from mcpo_megatron.rollout.placement import LocalRollouts
from mcpo_megatron.trainer import loop, step_data
from mcpo_megatron.trainer.metrics import StepTimer, step_metrics
from mcpo_megatron.trainer.schedule import GenerationSchedule

G = 2  # rollout.n


class FakeEngine:
    """Records each call's sampling seed; every response is one token."""

    def __init__(self):
        self.seeds = []

    def generate(self, prompts, sampling, *, prompt_indices, should_stop=None):
        self.seeds.append(sampling.seed)
        return RolloutOutput([RolloutSample(j, i, [5], [-0.1], "stop") for j in prompt_indices
                              for i in range(sampling.n)])

    def wake_up(self):
        pass


class FakeSetup:
    """collect_rollouts' view of TrainingSetup: a cycling sampler, the engine (colocated, holding the weights of
    version ``step``) and a scorer whose groups are all wrong except in the generation batches listed in
    ``mixed_batches``."""

    def __init__(self, num_prompts, batch_size, cfg, mixed_batches=(), statuses=None, step=0):
        self.cfg = cfg
        self.engine = FakeEngine()
        self.prompt_ids = [[1, 2, 3]] * num_prompts
        self.stop_token_ids = [0]
        self._batch_size, self._next, self._calls = batch_size, 0, 0
        self._mixed, self._statuses = set(mixed_batches), statuses
        self.rollouts = LocalRollouts(self.engine)
        self.rollouts.publish(SimpleNamespace(push=lambda engine: None), version=step)
        self.schedule = GenerationSchedule(self.rollouts, self, self.prompt_ids, cfg, self.stop_token_ids)
        self.tracker = mastery.MasteryTracker()

    def next_batch(self):
        idx = [(self._next + k) % len(self.prompt_ids) for k in range(self._batch_size)]
        self._next += self._batch_size
        return idx

    @property
    def sampler(self):
        return self

    def fake_score(self, prompt_idx, out, n, version=0):
        correct = [float(self._calls in self._mixed and i == 0) for i in range(len(out))]  # group 0 mixed
        self._calls += 1
        return step_data.Rollouts(
            group_size=n, uids=[f"p{i}" for i in prompt_idx], prompt_ids=[self.prompt_ids[i] for i in prompt_idx],
            response_ids=out.token_ids, rollout_logp=out.logprobs, finish_reasons=out.finish_reasons,
            scores=torch.tensor([1.0 if c else -1.0 for c in correct], dtype=torch.float64),
            correct=torch.tensor(correct, dtype=torch.float64),
            statuses=list(self._statuses or ["ok"] * len(out)), gcpo_injected=torch.zeros(len(out), dtype=torch.bool),
            versions=torch.full((len(out),), version, dtype=torch.long))


@pytest.fixture(autouse=True)
def fake_scorer(monkeypatch):
    """step_data.score as the fake setup scores."""
    monkeypatch.setattr(step_data, "score", lambda s, *args, **kwargs: s.fake_score(*args, **kwargs))


def _cfg(*overrides):
    return load_config(None, ["rollout.n=2", "data.train_batch_size=2", "algorithm.mini_batch_size=2",
                              "algorithm.name=dapo", "reward.overlong_buffer.enable=false", *overrides])


def test_hundred_generation_batches_get_distinct_seeds():
    cfg = _cfg("algorithm.filter_groups.max_gen_batches=100")
    seeds = {}
    for step in range(3):
        s = FakeSetup(num_prompts=8, batch_size=2, cfg=cfg, mixed_batches=[99], step=step)  # all but the last dropped
        loop.collect_rollouts(s, step, StepTimer())
        assert len(s.engine.seeds) == 100
        seeds[step] = s.engine.seeds
    every = [x for v in seeds.values() for x in v]
    assert len(set(every)) == len(every) == 300
    cfg = _cfg("diagnostics.retention_probe=true")
    probe = FakeSetup(num_prompts=8, batch_size=2, cfg=cfg)
    probe.uid_to_index = {f"p{i}": i for i in range(8)}
    for step in range(3):
        probe.rollouts.version = step
        probe.tracker.update(["p1", "p2"], [1.0, 1.0], [True, True], step - 1)
        loop.take_retention_probe(probe, loop.submit_retention_probe(probe, step))
    assert len(set(probe.engine.seeds)) == 3 and not set(probe.engine.seeds) & set(every)


def test_dynamic_sampling_reports_a_partial_batch():
    cfg = _cfg("algorithm.filter_groups.max_gen_batches=3")
    s = FakeSetup(num_prompts=8, batch_size=2, cfg=cfg, mixed_batches=[2])  # one mixed group in 3 batches: 1 < 2
    rollouts, generation = loop.collect_rollouts(s, 0, StepTimer())
    assert rollouts.num_groups == 1 and generation.num_batches == 3
    assert generation.filter_counts["partial_batch"] == 1
    assert generation.warnings == [
        "dynamic sampling: 1 of 2 groups after algorithm.filter_groups.max_gen_batches=3 generation batches; "
        "training on a partial batch (filter/partial_batch=1)"]

    full = FakeSetup(num_prompts=8, batch_size=2, cfg=cfg, mixed_batches=[0, 1])
    rollouts, generation = loop.collect_rollouts(full, 0, StepTimer())
    assert rollouts.num_groups == 2 and generation.num_batches == 2
    assert generation.filter_counts["partial_batch"] == 0 and generation.warnings == []


def _step_record(statuses, cfg):
    s = FakeSetup(num_prompts=2, batch_size=2, cfg=cfg, mixed_batches=[0], statuses=statuses)
    r, generation = loop.collect_rollouts(s, 0, StepTimer())
    rewards = step_data.shaped_rewards(r, cfg)
    adv = step_data.compute_advantages(r, rewards, cfg)
    stats = mastery.group_stats(r.correct, G)
    reshard = SimpleNamespace(seconds=1.0, gbps=1.0)
    outcome = step_data.StepOutcome(r, rewards, adv, stats, generation, mismatch={},
                                    updates=step_data.PolicyUpdates(grad_norms=[0.0]), reshard=reshard)
    return step_metrics(outcome, mastery.MasteryTracker(), cfg, inert=False)


def test_step_record_counts_every_reward_status_the_rewards_package_defines(monkeypatch):
    from mcpo_megatron.rewards import types

    cfg = _cfg("algorithm.filter_groups.enable=false")
    m = _step_record(["ok", "timeout", "crashed", "ok"], cfg)
    assert {k: v for k, v in m.items() if k.startswith("reward/status_")} == {
        "reward/status_ok": 2, "reward/status_no_answer": 0, "reward/status_timeout": 1, "reward/status_crashed": 1}
    # a status the rewards package adds is counted without touching the trainer
    monkeypatch.setattr(types, "STATUSES", (*types.STATUSES, "skipped"))
    m = _step_record(["ok", "skipped", "skipped", "ok"], cfg)
    assert m["reward/status_skipped"] == 2 and m["reward/status_ok"] == 2
    with pytest.raises(ValueError, match="unknown reward status 'oom'"):
        _step_record(["ok", "oom", "ok", "ok"], cfg)
