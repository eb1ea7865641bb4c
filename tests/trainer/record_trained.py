"""Runs the trainer like ``mcpo train`` and, on the trainer's rank 0, appends one JSON line per global step to
``$MCPO_TEST_TRAINED``: the step, the prompt uids it trained on (group order) and each sample's policy version.
With ``$MCPO_TEST_CRASH_STEP`` every trainer rank SIGKILLs itself right after that step's checkpoint (a node
dying mid-run); with ``$MCPO_TEST_SIGNAL_STEP`` (1-based) the trainer's rank 0 sends itself SIGUSR1 as it starts
waiting for that step's rollouts (a preemption during generation)."""

import json
import os
import signal
import sys

import crash_after_checkpoint  # noqa: F401  (the SIGKILL after $MCPO_TEST_CRASH_STEP's checkpoint)
from mcpo_megatron.rollout import remote
from mcpo_megatron.trainer import loop

_step_metrics = loop.step_metrics


def _recorded(o, *args, **kwargs):
    if os.environ.get("MCPO_ROLE", "train") == "train" and os.environ["RANK"] == "0":
        with open(os.environ["MCPO_TEST_TRAINED"], "a") as f:
            f.write(json.dumps({"uids": list(o.rollouts.uids), "versions": o.rollouts.versions.tolist()}) + "\n")
    return _step_metrics(o, *args, **kwargs)


loop.step_metrics = _recorded

if os.environ.get("MCPO_TEST_SIGNAL_STEP"):
    _result = remote.RemoteRollouts.result

    def _result_signalled(self, key, **kwargs):
        step, index = key
        if self.leader and index == 0 and step + 1 == int(os.environ["MCPO_TEST_SIGNAL_STEP"]):
            os.kill(os.getpid(), signal.SIGUSR1)
        return _result(self, key, **kwargs)

    remote.RemoteRollouts.result = _result_signalled

if __name__ == "__main__":
    from mcpo_megatron.cli import main

    sys.exit(main(["train", *sys.argv[1:]]))
