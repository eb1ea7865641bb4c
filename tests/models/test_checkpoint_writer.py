"""megatron's checkpoint writer keeps a helper process from the first save on; the scheduler's signals, which
reach every process of a job step, must not kill it (else the save made on a preemption signal fails)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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
    """start_checkpoint_writer sets the queue megatron's writer reads (a private variable of megatron-core's
    filesystem_async module): fail here, by name, if megatron changes it."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    assert hasattr(filesystem_async, "_results_queue") and callable(filesystem_async._get_write_results_queue)
