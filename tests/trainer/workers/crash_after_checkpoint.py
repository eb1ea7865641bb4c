"""Runs the trainer like ``mcpo train`` but SIGKILLs every rank right after the checkpoint
of step ``$MCPO_TEST_CRASH_STEP`` is complete: a deterministic stand-in for a node dying mid-run. Imported by
other test entry points for the same hook (it does nothing without the variable)."""

import os
import signal
import sys


def _install_hook() -> None:
    from mcpo_megatron.trainer import checkpoint

    save = checkpoint.CheckpointManager.save

    def save_then_die(self, step, **kwargs):
        path = save(self, step, **kwargs)
        if step == int(os.environ.get("MCPO_TEST_CRASH_STEP", -1)):
            os.kill(os.getpid(), signal.SIGKILL)
        return path

    checkpoint.CheckpointManager.save = save_then_die


# The reward workers (multiprocessing's spawn) re-import this script as __mp_main__ before their address-space
# cap (reward.memory_mb, 2 GiB) applies: the hook, which imports torch (3 GB of address space for its CUDA build),
# belongs to the trainer's process only.
if __name__ != "__mp_main__":
    _install_hook()

if __name__ == "__main__":
    from mcpo_megatron.cli import main

    sys.exit(main(["train", *sys.argv[1:]]))
