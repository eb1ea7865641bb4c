"""Runs the trainer like ``mcpo train`` and, on the trainer's rank 0, appends one JSON line per global step to
``$MCPO_TEST_TRAINED``: the step, the prompt uids it trained on (group order) and each sample's policy version.
With ``$MCPO_TEST_CRASH_STEP`` every trainer rank SIGKILLs itself right after that step's checkpoint (a node
dying mid-run); with ``$MCPO_TEST_SIGNAL_STEP`` (1-based) the trainer's rank 0 sends itself SIGUSR1 as it starts
waiting for that step's rollouts (a preemption during generation; with ``$MCPO_TEST_SIGNAL_SEGMENT`` and partial
rollouts, colocated: as its engine starts that segment of that step's batch); with ``$MCPO_TEST_ENGINE_FREEZE_STEP``
(1-based) the engine rank freezes in that step's generation: its heartbeat stops and its generation never ends (a
frozen process or a lost node), and it writes the time it froze to ``$MCPO_TEST_FROZEN_AT``."""

import json
import os
import signal
import sys
import threading
import time

import crash_after_checkpoint  # noqa: F401  (the SIGKILL after $MCPO_TEST_CRASH_STEP's checkpoint)
from mcpo_megatron.rollout.separate import remote
from mcpo_megatron.trainer import loop

_step_metrics = loop.step_metrics


def _recorded(o, *args, **kwargs):
    if os.environ.get("MCPO_ROLE", "train") == "train" and os.environ["RANK"] == "0":
        with open(os.environ["MCPO_TEST_TRAINED"], "a") as f:
            f.write(json.dumps({"uids": list(o.rollouts.uids), "versions": o.rollouts.versions.tolist(),
                                "token_versions": o.rollouts.token_versions,
                                "lengths": [len(r) for r in o.rollouts.response_ids]}) + "\n")
    return _step_metrics(o, *args, **kwargs)


loop.step_metrics = _recorded

if os.environ.get("MCPO_TEST_SIGNAL_STEP") and not os.environ.get("MCPO_TEST_SIGNAL_SEGMENT"):
    _result = remote.RemoteRollouts.result

    def _result_signalled(self, key, **kwargs):
        step, index = key
        if self.leader and index == 0 and step + 1 == int(os.environ["MCPO_TEST_SIGNAL_STEP"]):
            os.kill(os.getpid(), signal.SIGUSR1)
        return _result(self, key, **kwargs)

    remote.RemoteRollouts.result = _result_signalled

if os.environ.get("MCPO_TEST_SIGNAL_SEGMENT"):
    # partial rollouts, colocated: rank 0 sends itself SIGUSR1 as its engine starts segment
    # $MCPO_TEST_SIGNAL_SEGMENT of step $MCPO_TEST_SIGNAL_STEP's batch: a preemption in the middle of generation
    from mcpo_megatron.rollout import placement
    from mcpo_megatron.rollout.engines.torch import session as torch_session

    _generate_partial, _step = placement.generate_partial, torch_session.TorchSession.step
    _at = {"batch": 0, "segment": 0}

    def _counting_batches(*args, **kwargs):
        _at["batch"] += 1
        _at["segment"] = 0
        return _generate_partial(*args, **kwargs)

    def _step_signalled(self, *args, **kwargs):
        _at["segment"] += 1
        if (os.environ["RANK"] == "0" and _at["batch"] == int(os.environ["MCPO_TEST_SIGNAL_STEP"])
                and _at["segment"] == int(os.environ["MCPO_TEST_SIGNAL_SEGMENT"])):
            os.kill(os.getpid(), signal.SIGUSR1)
        return _step(self, *args, **kwargs)

    placement.generate_partial = _counting_batches
    torch_session.TorchSession.step = _step_signalled

if os.environ.get("MCPO_TEST_ENGINE_FREEZE_STEP"):
    from mcpo_megatron.rollout.separate import liveness
    from mcpo_megatron.rollout.engines.torch import engine as torch_engine

    _frozen = threading.Event()
    _beat, _generate_batch = liveness.Heartbeat._beat, torch_engine.TorchRolloutEngine.generate
    _batches = [0]

    def _beat_unless_frozen(self):
        if not _frozen.is_set():
            _beat(self)

    def _generate_or_freeze(self, *args, **kwargs):
        _batches[0] += 1
        if os.environ.get("MCPO_ROLE") == "rollout" and _batches[0] == int(os.environ["MCPO_TEST_ENGINE_FREEZE_STEP"]):
            _frozen.set()
            with open(os.environ["MCPO_TEST_FROZEN_AT"], "w") as f:
                f.write(str(time.time()))
            while True:
                time.sleep(1)
        return _generate_batch(self, *args, **kwargs)

    liveness.Heartbeat._beat = _beat_unless_frozen
    torch_engine.TorchRolloutEngine.generate = _generate_or_freeze

if __name__ == "__main__":
    from mcpo_megatron.cli import main

    sys.exit(main(["train", *sys.argv[1:]]))
