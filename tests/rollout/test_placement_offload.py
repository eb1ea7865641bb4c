"""LocalRollouts with trainer.offload: the engine and the training state take turns on the GPU. The order is the
contract: what the weight update does not read leaves before the engine wakes, the weights leave once the engine
has them, the engine sleeps before the state comes back, and a checkpoint gets the state back and the engine its
weights again (the same version)."""

from __future__ import annotations

from mcpo_megatron.rollout.placement import LocalRollouts


class Recorder:
    def __init__(self):
        self.events: list[str] = []


class FakeEngine:
    def __init__(self, rec):
        self.rec = rec

    def wake_up(self):
        self.rec.events.append("engine.wake_up")

    def sleep(self):
        self.rec.events.append("engine.sleep")

    def close(self):
        pass


class FakeOffload:
    def __init__(self, rec):
        self.rec, self.offloaded = rec, False

    def offload(self, *, keep_params=False):
        self.rec.events.append("offload(keep_params)" if keep_params else "offload")
        self.offloaded = True

    def onload(self):
        self.rec.events.append("onload")
        self.offloaded = False


class FakeResharder:
    def __init__(self, rec):
        self.rec = rec

    def push(self, engine):
        self.rec.events.append("push")
        return "stats"


def _placement():
    rec = Recorder()
    return rec, LocalRollouts(FakeEngine(rec), offload=FakeOffload(rec)), FakeResharder(rec)


def test_publish_moves_the_state_out_around_the_weight_update_and_after_rollouts_brings_it_back():
    rec, rollouts, resharder = _placement()
    assert rollouts.publish(resharder, version=3) == "stats" and rollouts.version == 3
    assert rec.events == ["offload(keep_params)", "engine.wake_up", "push", "offload"]
    rec.events.clear()
    rollouts.after_rollouts()
    assert rec.events == ["engine.sleep", "onload"]


def test_a_checkpoint_gets_the_state_back_and_the_engine_its_weights_again():
    rec, rollouts, resharder = _placement()
    rollouts.publish(resharder, version=5)
    rec.events.clear()
    with rollouts.training_state_resident():
        rec.events.append("save")
    assert rec.events == ["engine.sleep", "onload", "save", "offload(keep_params)", "engine.wake_up", "push",
                          "offload"]
    assert rollouts.version == 5 and rollouts.offload.offloaded
    rec.events.clear()
    rollouts.after_rollouts()
    with rollouts.training_state_resident():  # resident already: nothing moves
        rec.events.append("save")
    assert rec.events == ["engine.sleep", "onload", "save"]


def test_an_error_in_the_checkpoint_leaves_the_engine_asleep():
    rec, rollouts, resharder = _placement()
    rollouts.publish(resharder, version=1)
    rec.events.clear()
    try:
        with rollouts.training_state_resident():
            raise OSError("disk full")
    except OSError:
        pass
    assert rec.events == ["engine.sleep", "onload"]  # no collective weight update after a failed save


def test_without_offload_nothing_moves():
    rec = Recorder()
    rollouts = LocalRollouts(FakeEngine(rec))
    rollouts.publish(FakeResharder(rec), version=0)
    with rollouts.training_state_resident():
        rec.events.append("save")
    rollouts.after_rollouts()
    assert rec.events == ["engine.wake_up", "push", "save", "engine.sleep"]
