"""Runs the trainer like ``mcpo train``, but rank 0 sends itself SIGUSR1 as the rollouts of
step ``$MCPO_TEST_SIGNAL_STEP`` (1-based) start: a preemption signal that reaches one rank during generation."""

import os
import signal
import sys


def _install_hook() -> None:
    from mcpo_megatron.rollout.engines.torch import engine as torch_engine

    generate = torch_engine.TorchRolloutEngine.generate
    calls = [0]

    def generate_signalled(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == int(os.environ["MCPO_TEST_SIGNAL_STEP"]) and os.environ.get("RANK") == "0":
            os.kill(os.getpid(), signal.SIGUSR1)
        return generate(self, *args, **kwargs)

    torch_engine.TorchRolloutEngine.generate = generate_signalled


# Not in the reward workers, which re-import this script as __mp_main__ (crash_after_checkpoint.py says why).
if __name__ != "__mp_main__":
    _install_hook()

if __name__ == "__main__":
    from mcpo_megatron.cli import main

    sys.exit(main(["train", *sys.argv[1:]]))
