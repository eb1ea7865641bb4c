"""In-flight weight updates (separate placement, partial rollouts): an engine takes a new version between two
segments of a running batch without draining it, over the real protocol (RemoteRollouts, WeightPublisher,
RolloutServer and the Bridge's message code on an in-memory store, as tests/rollout/separate/test_remote.py).

The engine's weight is one number, the policy version; each token it samples records that number as its log-prob,
and the session stamps the version it was given. So a token's log-prob says which weights actually computed it,
and its version what the engine claims: both must switch at the same token.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from mcpo_megatron.rollout.engines.interface import SamplingParams
from mcpo_megatron.rollout.separate.liveness import Heartbeat
from mcpo_megatron.rollout.engines.records import GenerationSession, SequenceRecord
from mcpo_megatron.rollout.separate.remote import RemoteRollouts
from mcpo_megatron.rollout.separate.server import RolloutServer
from mcpo_megatron.rollout.partial.segments import GroupWork, PartialRequest

from test_remote import WAITS, Resharder, VersionedEngine, memory_bridges

LENGTHS = [9, 3, 7]  # each response's length: its prompt's first token


class Session(GenerationSession):
    def __init__(self, engine, prompts, records, sampling):
        self.engine, self.prompts = engine, prompts
        self.records = [SequenceRecord(r.prompt_index, r.sample_index, r.seed, list(r.token_ids),
                                       list(r.logprobs), list(r.versions)) for r in records]

    def step(self, max_tokens, *, version, should_stop=None):
        for prompt, r in zip(self.prompts, self.records):
            for _ in range(max_tokens):
                if r.finished:
                    break
                r.token_ids.append(7)
                r.logprobs.append(float(self.engine.w.item()))  # the weights that computed it
                r.versions.append(int(version))
                if len(r.token_ids) == prompt[0]:
                    r.finish_reason = "stop"
        self.engine.steps += 1
        return self.running

    def close(self):
        return self.records


class SessionEngine(VersionedEngine):
    def __init__(self):
        super().__init__()
        self.steps = 0

    def open_session(self, prompts, records, sampling):
        return Session(self, prompts, records, sampling)


def request(step: int, mode: str, update_after: int) -> PartialRequest:
    groups = [GroupWork(g, [n], [SequenceRecord(g, 0, seed=g)]) for g, n in enumerate(LENGTHS)]
    return PartialRequest((step, 0), groups, need=len(groups), sampling=SamplingParams(n=1, max_new_tokens=16),
                          segment_tokens=1, min_version=step - 1, inflight=mode, inflight_version=step,
                          update_after=update_after)


def serve(engine):
    trainer_bridge, engine_bridge = memory_bridges(1)
    heartbeat = Heartbeat(engine_bridge.store.clone(), engine_bridge.rank, WAITS.beat_period_s)
    thread = threading.Thread(target=lambda: RolloutServer(engine_bridge, engine, rank=0, heartbeat=heartbeat).serve(),
                              daemon=True)
    thread.start()
    rollouts = RemoteRollouts(trainer_bridge, engine_ranks=1, waits=WAITS)
    return rollouts, thread, heartbeat


def run_batch(mode: str, *, publish_delay_s: float, update_after: int = 3):
    """Version 0 published; the batch for step 1 submitted; version 1 published after ``publish_delay_s`` while
    the batch runs. Returns (its records, the metrics of the batch)."""
    engine = SessionEngine()
    rollouts, thread, heartbeat = serve(engine)
    resharder = Resharder()
    try:
        rollouts.publish(resharder, version=0)
        rollouts.submit_partial(request(1, mode, update_after))
        time.sleep(publish_delay_s)
        resharder.value = 1
        rollouts.publish(resharder, version=1)  # the trainer's step 0 is done: version 1, mid-batch
        batch = rollouts.result((1, 0))
        return [r for g in batch.output.members for r in g], rollouts.generation_metrics([batch]), engine
    finally:
        rollouts.close()
        thread.join(30)
        heartbeat.close()


@pytest.mark.parametrize("delay", [0.0, 0.5])
def test_repeatable_updates_switch_at_the_same_token_whatever_the_timing(delay):
    """Repeatable: version 1 is taken after exactly segment 3 (the engine waits for it when it is not published
    yet), so the tokens from the 4th on are version 1, computed by version 1's weights, published early or late."""
    records, m, _ = run_batch("repeatable", publish_delay_s=delay, update_after=3)
    for r, n in zip(records, LENGTHS):
        want = [0] * min(n, 3) + [1] * max(0, n - 3)
        assert r.versions == want and r.logprobs == [float(v) for v in want], (n, r.versions, r.logprobs)
        assert r.finished
    assert m["async/inflight_updates"] == 1 and m["async/weight_updates"] == 2  # version 0 first, 1 in flight


def test_a_late_version_is_waited_for_between_segments():
    """The batch stops after segment 3 until version 1 is published (the engines' wait is reported): no token of
    version 0 after it."""
    records, m, engine = run_batch("repeatable", publish_delay_s=1.0, update_after=3)
    longest = max(records, key=lambda r: len(r.token_ids))
    assert longest.versions == [0] * 3 + [1] * 6 and m["time/engine_weight_wait"] >= 0.5
    assert engine.steps == max(LENGTHS)  # one segment of one token per step, none lost to the wait


def test_fast_updates_take_the_version_at_the_first_boundary_after_it_is_published():
    """Fast: the version is taken at a wall-clock point; every token after the switch is of the new version and
    computed by it, and the switch comes after version 1 exists."""
    records, m, _ = run_batch("fast", publish_delay_s=0.0)
    for r in records:
        first = r.versions.index(1) if 1 in r.versions else len(r.versions)
        assert r.versions == [0] * first + [1] * (len(r.versions) - first)
        assert r.logprobs == [float(v) for v in r.versions]
    assert m["async/inflight_updates"] <= 1


def test_off_takes_versions_between_batches_only():
    records, m, _ = run_batch("off", publish_delay_s=0.0)
    assert all(set(r.versions) == {0} for r in records) and m["async/inflight_updates"] == 0


def test_waiting_for_a_batch_that_waits_for_an_unpublished_version_is_refused():
    """Repeatable: after segment 1 the batch for step 1 waits for version 1. Waiting for the batch before
    publishing version 1 could only hang (the trainer publishes at its own fixed points): the leader says so at
    once, on every trainer rank."""
    engine = SessionEngine()
    rollouts, thread, heartbeat = serve(engine)
    try:
        rollouts.publish(Resharder(), version=0)
        rollouts.submit_partial(request(1, "repeatable", update_after=1))
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"^the trainer leader failed while waiting for generation batch "
                                               r"\(1, 0\): RuntimeError: generation batch \(1, 0\) cannot be "
                                               r"finished: the engines wait for a version that is not staged"):
            rollouts.result((1, 0))
        assert time.monotonic() - t0 < 5.0
    finally:
        rollouts.close()  # the waiting batch is told to stop
        thread.join(30)
        heartbeat.close()
    assert not thread.is_alive()
