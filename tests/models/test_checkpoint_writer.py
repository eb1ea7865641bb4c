"""megatron's checkpoint writer keeps a helper process from the first save on; the scheduler's signals, which
reach every process of a job step, must not kill it (else the save made on a preemption signal fails)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def test_save_after_the_helpers_were_signalled(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    env.pop("RANK", None)
    proc = subprocess.run([sys.executable, str(HERE / "workers" / "ckpt_signal_worker.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "signalling 1 helper(s)" in out or "signalling 2 helper(s)" in out, out[-2000:]
    assert "second save ok; signal seen by the rank: SIGTERM" in out, out[-2000:]


def test_writer_contract_of_megatron():
    """The queue set through parallel/mcore_compat.py is the one megatron's writer takes at its next save (its
    getter is named per release: 0.17 dropped the underscore): fail here, by name, if megatron changes it."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from mcpo_megatron.parallel import mcore_compat

    getter = "_get_write_results_queue" if mcore_compat.require_supported() < (0, 17, 0) else "get_write_results_queue"
    assert callable(getattr(filesystem_async, getter))
    queue = object()
    saved = filesystem_async._results_queue
    try:
        filesystem_async._results_queue = None
        assert not mcore_compat.has_checkpoint_results_queue()
        mcore_compat.set_checkpoint_results_queue(queue)
        assert mcore_compat.has_checkpoint_results_queue()
        assert getattr(filesystem_async, getter)() is queue and mcore_compat.checkpoint_results_queue() is queue
        with pytest.raises(RuntimeError, match="already has its results queue"):
            mcore_compat.set_checkpoint_results_queue(object())
    finally:
        filesystem_async._results_queue = saved
