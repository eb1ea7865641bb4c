"""Run a worker script under ``torch.distributed.run`` for multi-process tests.

Multi-process tests call :func:`run_torchrun` once per test module (in a
module-scoped fixture); the worker script writes its results (JSON or
``torch.save`` files) into a temporary directory passed as an argument, and the
pytest side asserts on those files.  Processes talk over gloo on localhost.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Mapping, Sequence

from mcpo_megatron.parallel.distributed import free_port

REPO_ROOT = Path(__file__).resolve().parents[1]


def run_torchrun(
    script: str | os.PathLike,
    nprocs: int,
    args: Sequence[str | os.PathLike] = (),
    timeout: float = 300,
    env: Mapping[str, str] | None = None,
    check: bool = True,
) -> subprocess.CompletedProcess:
    """Run ``python -m torch.distributed.run --nproc_per_node nprocs script *args``.

    The children get ``OMP_NUM_THREADS=1`` (the CI machine has two cores and
    several tests run at once) and the repository root on ``PYTHONPATH``.
    ``env`` entries override the inherited environment.

    Returns the ``CompletedProcess`` (text stdout/stderr).  Raises
    ``AssertionError`` carrying the full stdout and stderr when the launcher
    runs past ``timeout`` seconds, or exits non-zero with ``check``.
    """
    if nprocs < 1:
        raise ValueError(f"run_torchrun: nprocs={nprocs!r} must be >= 1")
    script = Path(script)
    if not script.is_file():
        raise FileNotFoundError(f"run_torchrun: worker script {script} does not exist")

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

    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nprocs),
        "--nnodes",
        "1",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        str(script),
        *[str(a) for a in args],
    ]
    try:
        proc = subprocess.run(
            cmd,
            env=child_env,
            cwd=str(REPO_ROOT),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        err = exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        raise AssertionError(
            f"torchrun timed out after {timeout}s: {' '.join(cmd)}\n"
            f"--- stdout ---\n{out}\n--- stderr ---\n{err}"
        ) from None
    if check and proc.returncode != 0:
        raise AssertionError(
            f"torchrun exited with {proc.returncode}: {' '.join(cmd)}\n"
            f"--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"
        )
    return proc


def run_json_worker(script: str | os.PathLike, out: Path, timeout: float = 600) -> dict:
    """Run ``python script out`` in one clean process (the repository on ``PYTHONPATH``, one thread, nothing else
    inherited: the CPU shim and its patches stay out of the test process) and return the JSON it wrote to ``out``."""
    proc = subprocess.run(
        [sys.executable, str(script), str(out)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout,
        env={"PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(Path(out).read_text())
