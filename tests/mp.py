"""Run a worker script as the ranks of one machine, as torchrun would, for multi-process tests.

Multi-process tests call :func:`run_ranks` once per test module (in a
module-scoped fixture); the worker script writes its results (JSON or
``torch.save`` files) into a temporary directory passed as an argument, and the
pytest side asserts on those files.  Processes talk over gloo on localhost.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Mapping, Sequence

from mcpo_megatron.parallel.distributed import free_port

REPO_ROOT = Path(__file__).resolve().parents[1]


def run_ranks(
    script: str | os.PathLike,
    nprocs: int,
    args: Sequence[str | os.PathLike] = (),
    timeout: float = 300,
    env: Mapping[str, str] | None = None,
    check: bool = True,
) -> subprocess.CompletedProcess:
    """Run ``python script *args`` as ranks 0..nprocs-1 of one machine, with the environment torchrun's
    ``--standalone`` gives its workers (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT: rank 0
    hosts the store) and torchrun's failure rule: once one rank fails, the others are stopped (SIGTERM to each
    rank's session, SIGKILL after :data:`STOP_GRACE_S`). The workers start at once, without torchrun's own
    process (a torch import, about 3 s each launch on the CI machine). The tests of the trainer's own launch
    (``mcpo train`` under torchrun or srun) use the real launchers.

    The children get ``OMP_NUM_THREADS=1`` (the CI machine has two cores and several tests run at once) and the
    repository root on ``PYTHONPATH``; ``env`` entries override the inherited environment.

    Returns a ``CompletedProcess`` whose stdout and stderr are the ranks' own, in rank order, and whose return code
    is the rank's that failed first (0 when all succeed). Raises ``AssertionError`` carrying them when the ranks run
    past ``timeout`` seconds, or one fails with ``check``.
    """
    if nprocs < 1:
        raise ValueError(f"run_ranks: nprocs={nprocs!r} must be >= 1")
    script = Path(script)
    if not script.is_file():
        raise FileNotFoundError(f"run_ranks: worker script {script} does not exist")

    child_env = dict(os.environ)
    child_env["OMP_NUM_THREADS"] = "1"
    child_env["MKL_NUM_THREADS"] = "1"
    child_env["PYTHONUNBUFFERED"] = "1"
    paths = [str(REPO_ROOT)]
    if child_env.get("PYTHONPATH"):
        paths.append(child_env["PYTHONPATH"])
    child_env["PYTHONPATH"] = os.pathsep.join(paths)
    if env:
        child_env.update({k: str(v) for k, v in env.items()})
    for name in ("TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RUN_ID"):  # rank 0 hosts the store itself
        child_env.pop(name, None)
    port = str(free_port())
    cmd = [sys.executable, str(script), *[str(a) for a in args]]

    with tempfile.TemporaryDirectory(prefix="ranks_") as logs:
        procs, files = [], []
        for rank in range(nprocs):
            out, err = open(Path(logs) / f"{rank}.out", "w+"), open(Path(logs) / f"{rank}.err", "w+")
            files.append((out, err))
            rank_env = dict(child_env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nprocs),
                            LOCAL_WORLD_SIZE=str(nprocs), GROUP_RANK="0", ROLE_RANK=str(rank),
                            ROLE_WORLD_SIZE=str(nprocs), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
            procs.append(subprocess.Popen(cmd, env=rank_env, cwd=str(REPO_ROOT), stdout=out, stderr=err,
                                          start_new_session=True))
        try:
            timed_out, first_failure = _wait_for_ranks(procs, timeout)
        finally:  # pytest's own timeout, or an interrupt, leaves no rank behind
            _stop(procs)
        stdout, stderr = "", ""
        for out, err in files:
            for f in (out, err):
                f.seek(0)
            stdout, stderr = stdout + out.read(), stderr + err.read()
            out.close()
            err.close()
    codes = [p.returncode for p in procs]
    returncode = first_failure if first_failure is not None else next((c for c in codes if c != 0), 0)
    if timed_out:
        raise AssertionError(f"the ranks ran past {timeout}s: {' '.join(cmd)}\n"
                             f"--- stdout ---\n{stdout}\n--- stderr ---\n{stderr}")
    if check and returncode != 0:
        raise AssertionError(f"the ranks exited with {codes}: {' '.join(cmd)}\n"
                             f"--- stdout ---\n{stdout}\n--- stderr ---\n{stderr}")
    return subprocess.CompletedProcess(cmd, returncode, stdout, stderr)


STOP_GRACE_S = 30.0  # torchrun's too


def _wait_for_ranks(procs: list[subprocess.Popen], timeout: float) -> tuple[bool, int | None]:
    """Wait until every rank has exited, stopping all once one fails or ``timeout`` passes; returns whether it
    timed out and the return code of the rank that failed first (None if none failed before the stop)."""
    deadline = time.monotonic() + timeout
    while None in [p.poll() for p in procs]:  # a list: every rank is polled, not only up to the first running
        failed = next((p.returncode for p in procs if p.returncode not in (None, 0)), None)
        if failed is not None or time.monotonic() > deadline:
            _stop(procs)
            return failed is None, failed
        time.sleep(0.05)
    return False, None


def _stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM to every running rank's session, SIGKILL to what is left after :data:`STOP_GRACE_S`."""
    for sig, grace in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 10.0)):
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass
        end = time.monotonic() + grace
        while None in [p.poll() for p in procs] and time.monotonic() < end:
            time.sleep(0.05)


def run_json_worker(script: str | os.PathLike, out: Path, timeout: float = 600) -> dict:
    """Run ``python script out`` in one clean process (the repository on ``PYTHONPATH``, one thread, nothing else
    inherited: the CPU shim and its patches stay out of the test process) and return the JSON it wrote to ``out``."""
    proc = subprocess.run(
        [sys.executable, str(script), str(out)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout,
        env={"PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(Path(out).read_text())
