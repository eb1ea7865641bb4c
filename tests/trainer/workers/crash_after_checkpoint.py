"""Runs the trainer like ``mcpo train`` but SIGKILLs every rank right after the checkpoint
of step ``$MCPO_TEST_CRASH_STEP`` is complete: a deterministic stand-in for a node dying mid-run. Imported by
other test entry points for the same hook (it does nothing without the variable)."""

import os
import signal
import sys

from mcpo_megatron.trainer import checkpoint

_save = checkpoint.CheckpointManager.save


def _save_then_die(self, step, **kwargs):
    path = _save(self, step, **kwargs)
    if step == int(os.environ.get("MCPO_TEST_CRASH_STEP", -1)):
        os.kill(os.getpid(), signal.SIGKILL)
    return path


checkpoint.CheckpointManager.save = _save_then_die

if __name__ == "__main__":
    from mcpo_megatron.cli import main

    sys.exit(main(["train", *sys.argv[1:]]))
