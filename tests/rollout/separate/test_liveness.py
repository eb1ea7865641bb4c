"""Separate placement's waits on the engines: the trainer leader's watch on the engine ranks' heartbeats (with a
fake clock), and the trainer's RemoteRollouts against a RolloutServer thread that goes silent, hangs with its
heartbeat alive, or is slow but alive (wall clock, limits of a second). Several trainer ranks and a real store:
tests/rollout/separate/test_liveness_mp.py; a whole run: tests/trainer/test_separate_e2e.py."""

from __future__ import annotations

import pickle
import threading
import time

import pytest

from mcpo_megatron.config import load_config
from mcpo_megatron.parallel.bridge import split_roles
from mcpo_megatron.rollout.separate.liveness import Beat, EnginesFailed, EngineWatch, Heartbeat, Waits, beat_key, engine_names
from mcpo_megatron.rollout.separate.remote import RemoteRollouts
from mcpo_megatron.rollout.separate.server import RolloutServer
from test_remote import SAMPLING, MemoryStore, Resharder, VersionedEngine, memory_bridges


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def beat(store, bridge_rank, count, batch=None, busy_s=0.0):
    store.set(beat_key(bridge_rank), pickle.dumps(Beat(count, batch, busy_s)))


WAITS = Waits(batch_s=100.0, heartbeat_s=10.0, batches_queued=2, slack_s=50.0)
# 3 trainer ranks and 2 engine ranks: the engines are launch ranks 3 and 4, bridge ranks 3 and 4 (every trainer
# rank is on the bridge: bridge ranks 0..2)
NAMES = engine_names(split_roles(0, 5, 2))
E0, E1 = 3, 4


def test_engine_names_give_engine_and_launch_rank():
    assert NAMES == {E0: "engine rank 0 (launch rank 3)", E1: "engine rank 1 (launch rank 4)"}


def test_the_watch_names_the_rank_that_stopped_beating_once_its_silence_passes_the_limit():
    store, clock = MemoryStore(), Clock()
    watch = EngineWatch(store, NAMES, WAITS, clock=clock)
    for t in range(16):  # engine rank 0 beats every second; engine rank 1 stops after t = 5
        clock.t = float(t)
        beat(store, E0, t)
        if t <= 5:
            beat(store, E1, t)
        watch.check("generation batch (0, 0)")  # at t = 15 rank 1 has been silent for 10 s: not over the limit
    clock.t = 16.0
    beat(store, E0, 16)
    with pytest.raises(EnginesFailed) as e:
        watch.check("generation batch (0, 0)")
    assert str(e.value).startswith(
        "engine rank 1 (launch rank 4) (silent 11 s): no heartbeat for longer than rollout.heartbeat_timeout_s=10 "
        "while the trainer waited for generation batch (0, 0)"), str(e.value)
    assert "engine rank 0" not in str(e.value)


def test_a_rank_that_never_beat_is_silent_from_the_watch_start():
    store, clock = MemoryStore(), Clock()
    watch = EngineWatch(store, NAMES, WAITS, clock=clock)
    clock.t = 10.0
    beat(store, E0, 1)
    watch.check("x")
    clock.t = 10.5
    with pytest.raises(EnginesFailed, match=r"^engine rank 1 \(launch rank 4\) \(silent 10 s\)"):
        watch.check("x")


def test_after_a_pause_a_changed_counter_is_fresh_and_an_unchanged_one_silent():
    """The leader looks only while it waits: an hour of training later, a rank that beat meanwhile is alive, one
    whose counter did not move has been silent all along."""
    store, clock = MemoryStore(), Clock()
    watch = EngineWatch(store, NAMES, WAITS, clock=clock)
    beat(store, E0, 1)
    beat(store, E1, 1)
    watch.check("x")
    clock.t = 3600.0
    beat(store, E0, 700)
    beat(store, E1, 700)
    watch.check("x")  # both beat during the pause
    clock.t = 7200.0
    beat(store, E0, 1400)  # rank 1's counter stays at 700
    with pytest.raises(EnginesFailed, match=r"^engine rank 1 \(launch rank 4\) \(silent 3600 s\)"):
        watch.check("x")


def test_a_rank_alive_but_longer_than_the_batch_limit_on_one_batch_is_named():
    store, clock = MemoryStore(), Clock()
    watch = EngineWatch(store, NAMES, WAITS, clock=clock)
    beat(store, E0, 1, "(3, 0)", 99.0)
    beat(store, E1, 1, "(3, 0)", 99.0)
    watch.check("generation batch (3, 0)")
    clock.t = 2.0
    beat(store, E0, 2, "(3, 0)", 101.0)
    beat(store, E1, 2, "(3, 0)", 100.0)
    with pytest.raises(EnginesFailed) as e:
        watch.check("generation batch (3, 0)")
    assert str(e.value).startswith("engine rank 0 (launch rank 3) on generation batch (3, 0) for 101 s: longer than "
                                   "rollout.batch_timeout_s=100 (the ranks are alive"), str(e.value)
    assert "engine rank 1" not in str(e.value)


def test_a_wait_longer_than_the_queued_batches_may_take_ends():
    store, clock = MemoryStore(), Clock()
    watch = EngineWatch(store, NAMES, WAITS, clock=clock)
    for t in range(0, 252, 2):  # beating, idle, nothing delivered
        clock.t = float(t)
        beat(store, E0, t)
        beat(store, E1, t)
        if t <= 250:  # 2 batches x 100 s + 50 s slack
            watch.check("generation batch (0, 1)", since=0.0)
    clock.t = 251.0
    beat(store, E0, 251)
    beat(store, E1, 251)
    with pytest.raises(EnginesFailed, match=r"^waited 251 s for generation batch \(0, 1\): longer than the 2 "
                                            r"generation batches"):
        watch.check("generation batch (0, 1)", since=0.0)


def test_waits_derive_from_the_config():
    cfg = load_config(None, ["rollout.placement=separate", "rollout.ranks=1", "trainer.max_staleness=1"])
    w = Waits.from_config(cfg)
    assert (w.batch_s, w.heartbeat_s, w.batches_queued, w.slack_s) == (14400.0, 120.0, 3, 1800.0)
    assert w.leader_s == 3 * 14400 + 1800 and w.trainer_group_s == w.leader_s + 1800
    assert w.engine_world_s == 14400 + 1800 and w.beat_period_s == 5.0
    small = Waits.from_config(load_config(None, ["rollout.batch_timeout_s=30", "rollout.heartbeat_timeout_s=2"]))
    assert (small.batches_queued, small.leader_s, small.beat_period_s) == (2, 2 * 30 + 1800, 0.5)


def test_the_engine_world_waits_as_long_as_a_batch_and_the_trainer_world_as_before():
    from mcpo_megatron.commands.train import role_world_timeout_s

    cfg = load_config(None, ["rollout.placement=separate", "rollout.ranks=1", "rollout.batch_timeout_s=7200"])
    assert role_world_timeout_s(cfg, "rollout") == 7200 + 1800
    assert role_world_timeout_s(cfg, "train") == 1800


def test_config_rules_for_the_waits():
    from mcpo_megatron.config import ConfigError, validate

    def problems(*overrides):
        with pytest.raises(ConfigError) as e:
            validate(load_config(None, list(overrides)), 1)
        return e.value.problems

    assert problems("rollout.heartbeat_timeout_s=0.5") == [
        "rollout.heartbeat_timeout_s=0.5: must be >= 1 (an engine rank beats every timeout / 4 s, at most every "
        "5 s); give the seconds an engine rank may stay silent, e.g. 120"]
    assert problems("rollout.batch_timeout_s=60", "rollout.heartbeat_timeout_s=60") == [
        "rollout.batch_timeout_s=60.0: must be > rollout.heartbeat_timeout_s=60; give the seconds the "
        "longest generation batch may take, e.g. 14400"]
    assert problems("rollout.batch_timeout_s=inf") == [
        "rollout.batch_timeout_s=inf: must be a finite number; set rollout.batch_timeout_s to a finite value"]
    validate(load_config(None, ["rollout.batch_timeout_s=3", "rollout.heartbeat_timeout_s=1"]), 1)


# --------------------------------------------------------------------------- the trainer against an engine thread
def within(seconds, fn):
    """``fn()``'s outcome (its value, or the exception it raised), or AssertionError when it is still waiting after
    ``seconds``: a wait that never ends fails the test instead of hanging it."""
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001  handed to the test
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t0 = time.monotonic()
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still waiting after {seconds} s"
    return box.get("error", box.get("value")), time.monotonic() - t0


class StallingEngine(VersionedEngine):
    """Generation takes ``delay_s``; or, with ``freeze``, it never ends and the heartbeat stops with it (a frozen
    process, a lost node), or it never ends and the heartbeat goes on (a main thread stuck in a collective), until
    ``release`` is set."""

    def __init__(self, heartbeat=None, *, delay_s=0.0, hang=False, freeze=False):
        super().__init__()
        self.heartbeat, self.delay_s, self.hang, self.freeze = heartbeat, delay_s, hang, freeze
        self.release = threading.Event()

    def generate(self, prompts, sampling, *, prompt_indices, should_stop=None):
        if self.freeze:
            self.heartbeat.close()
        if self.hang or self.freeze:
            self.release.wait(60)
        time.sleep(self.delay_s)
        return super().generate(prompts, sampling, prompt_indices=prompt_indices)


@pytest.fixture
def engines():
    """Start (waits, engine factory) -> (RemoteRollouts, engine); ends every engine thread."""
    started = []

    def start(waits, **engine_kw):
        trainer_bridge, engine_bridge = memory_bridges(1)
        heartbeat = Heartbeat(engine_bridge.store.clone(), engine_bridge.rank, waits.beat_period_s)
        engine = StallingEngine(heartbeat, **engine_kw)
        thread = threading.Thread(
            target=lambda: RolloutServer(engine_bridge, engine, rank=0, heartbeat=heartbeat).serve(), daemon=True)
        thread.start()
        rollouts = RemoteRollouts(trainer_bridge, engine_ranks=1, waits=waits)
        started.append((rollouts, engine, heartbeat, thread))
        rollouts.publish(Resharder(), version=0)
        return rollouts, engine

    yield start
    for rollouts, engine, heartbeat, thread in started:
        engine.release.set()
        rollouts.close()
        if rollouts.failed:  # an engine declared failed but released here: its asks are answered until its goodbye
            rollouts.publisher.close(timeout_s=30)
        thread.join(30)
        heartbeat.close()
        assert not thread.is_alive()


FAST = Waits(batch_s=30.0, heartbeat_s=1.0, batches_queued=2, slack_s=5.0)


def test_a_frozen_engine_rank_is_named_within_the_heartbeat_timeout(engines):
    rollouts, _ = engines(FAST, freeze=True)
    rollouts.submit((0, 0), [[1]], SAMPLING, min_version=0)
    error, waited = within(10, lambda: rollouts.result((0, 0)))
    assert isinstance(error, RuntimeError), error
    assert str(error).startswith("the rollout ranks failed on generation batch (0, 0): engine rank 0 (launch rank 1) "
                                 "(silent 1 s): no heartbeat for longer than rollout.heartbeat_timeout_s=1 "), error
    assert waited < FAST.heartbeat_s + 1.5, waited
    assert rollouts.failed
    _, closing = within(10, rollouts.close)  # no goodbye is waited for from failed engines
    assert closing < 1.0


def test_an_engine_alive_but_stuck_is_named_at_the_batch_limit(engines):
    waits = Waits(batch_s=2.0, heartbeat_s=1.0, batches_queued=2, slack_s=5.0)
    rollouts, _ = engines(waits, hang=True)
    rollouts.submit((0, 0), [[1]], SAMPLING, min_version=0)
    error, waited = within(10, lambda: rollouts.result((0, 0)))
    assert isinstance(error, RuntimeError), error
    assert str(error).startswith("the rollout ranks failed on generation batch (0, 0): engine rank 0 (launch rank 1) "
                                 "on generation batch (0, 0) for 2 s: longer than rollout.batch_timeout_s=2 "), error
    assert waits.batch_s <= waited < waits.batch_s + 2.0, waited


def test_a_slow_engine_that_beats_is_waited_for(engines):
    """3 s of generation against a heartbeat limit of 1 s: the beats go on, the batch is awaited, its samples are
    the engine's."""
    rollouts, _ = engines(FAST, delay_s=3.0)
    rollouts.submit((0, 0), [[1], [2]], SAMPLING, min_version=0)
    batch, waited = within(20, lambda: rollouts.result((0, 0)))
    assert not isinstance(batch, BaseException), batch
    assert waited >= 3.0 and batch.version == 0 and not rollouts.failed
    assert [(s.prompt_index, s.logprobs) for s in batch.output.samples] == [(0, [0.0])] * 2 + [(1, [0.0])] * 2


def test_publishing_while_a_frozen_engine_holds_a_needed_version_ends_in_an_error(engines):
    """max_staleness 1: batch (1, 0) needs version 0 too, so version 1 may be staged only once the engines took it
    for that batch; they froze on batch (0, 0). The publish names the rank instead of waiting for ever."""
    rollouts, _ = engines(FAST, freeze=True)
    rollouts.submit((0, 0), [[1]], SAMPLING, min_version=0)
    rollouts.submit((1, 0), [[2]], SAMPLING, min_version=0)
    resharder = Resharder()
    resharder.value = 1
    error, waited = within(10, lambda: rollouts.publish(resharder, version=1))
    assert isinstance(error, RuntimeError), error
    assert str(error).startswith("the rollout ranks failed before version 1 could be published: engine rank 0 "
                                 "(launch rank 1) (silent "), error
    assert "while the trainer waited for the engines to take version 0 before version 1 is staged" in str(error)
    assert waited < FAST.heartbeat_s + 1.5 and rollouts.failed
