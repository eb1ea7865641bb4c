"""Runs the trainer like ``mcpo train``, but rank 0 sends itself SIGUSR1 as the rollouts of
step ``$MCPO_TEST_SIGNAL_STEP`` (1-based) start: a preemption signal that reaches one rank during generation."""

import os
import signal
import sys

from mcpo_megatron.rollout import torch_engine

_generate = torch_engine.TorchRolloutEngine.generate
_calls = [0]


def _generate_signalled(self, *args, **kwargs):
    _calls[0] += 1
    if _calls[0] == int(os.environ["MCPO_TEST_SIGNAL_STEP"]) and os.environ.get("RANK") == "0":
        os.kill(os.getpid(), signal.SIGUSR1)
    return _generate(self, *args, **kwargs)


torch_engine.TorchRolloutEngine.generate = _generate_signalled

if __name__ == "__main__":
    from mcpo_megatron.cli import main

    sys.exit(main(["train", *sys.argv[1:]]))
