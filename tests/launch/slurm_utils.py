"""Helpers for the SLURM tests: cluster discovery, sbatch submission, job-state polling, metrics."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CPU_CONFIG = "configs/cpu_smollm2_arith.yaml"
# A few short steps of the CPU default (2 ranks, TP=2) on a tiny random model with a character tokenizer
# (mcpo_megatron/models/tiny.py; `model_overrides()`), so that a job starts in seconds. checkpoint.interval is large
# so that in the preemption test the only mid-run checkpoint is the one written on the signal. The launchers are
# under test, not the engine: the PyTorch engine starts at once (and vLLM's CPU attention needs head sizes >= 32).
TINY = ["data.train_batch_size=4", "algorithm.mini_batch_size=2", "rollout.n=2", "rollout.max_new_tokens=8",
        "data.max_response_length=8", "checkpoint.interval=100", "checkpoint.keep_last=2",
        "logging.tensorboard=false", "rollout.engine=torch"]
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
            "PREEMPTED"}


def cluster() -> dict | None:
    """``{"nodes": N, "cpus": min CPUs per node}`` of the reachable SLURM cluster, or None (with the reason in
    ``cluster.reason``)."""
    if shutil.which("sinfo") is None:
        cluster.reason = "no SLURM cluster reachable: `sinfo` is not installed"
        return None
    try:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %c %T"], text=True, capture_output=True, timeout=20)
    except subprocess.TimeoutExpired:
        cluster.reason = "no SLURM cluster reachable: `sinfo` timed out"
        return None
    if out.returncode != 0:
        cluster.reason = f"no SLURM cluster reachable: `sinfo` failed: {out.stderr.strip()[:200]}"
        return None
    rows = [line.split() for line in out.stdout.splitlines() if line.strip()]
    usable = {r[0]: int(r[1]) for r in rows if r[2].rstrip("*~#") in ("idle", "mixed", "allocated", "completing")}
    if not usable:
        cluster.reason = f"SLURM cluster has no usable node: {out.stdout.strip()[:200]}"
        return None
    return {"nodes": len(usable), "cpus": min(usable.values())}


cluster.reason = ""


def model_overrides(model_dir: str | Path) -> list[str]:
    return [f"model.path={model_dir}", "model.dtype=fp32"]


def env() -> dict:
    e = dict(os.environ, OMP_NUM_THREADS="1", MCPO_REPO=str(REPO))
    e.pop("SLURM_JOB_ID", None)
    return e


def sbatch(script: str, sbatch_args: list[str], args: list[str], out_file: Path, env_extra: dict | None = None) -> int:
    """Submit ``slurm/<script>``; ``env_extra`` is exported to the job (sbatch passes the environment on)."""
    cmd = ["sbatch", "--parsable", f"--output={out_file}", f"--chdir={REPO}", "--time=00:20:00", *sbatch_args,
           str(REPO / "slurm" / script), *args]
    r = subprocess.run(cmd, text=True, capture_output=True, env={**env(), **(env_extra or {})}, timeout=60)
    assert r.returncode == 0, f"{' '.join(cmd)} failed: {r.stdout}{r.stderr}"
    return int(r.stdout.strip().split(";")[0])


def job_info(job: int) -> dict:
    """JobState / Restarts / Reason from scontrol (sacct as a fallback once the job left slurmctld)."""
    r = subprocess.run(["scontrol", "show", "job", str(job)], text=True, capture_output=True, timeout=20)
    if r.returncode == 0 and "JobState=" in r.stdout:
        return dict(re.findall(r"(\w+)=(\S+)", r.stdout))
    r = subprocess.run(["sacct", "-j", str(job), "-X", "-n", "-P", "-o", "State,ExitCode"], text=True,
                       capture_output=True, timeout=20)
    state = r.stdout.strip().splitlines()[0].split("|")[0].split()[0] if r.stdout.strip() else "UNKNOWN"
    return {"JobState": state}


def wait_job(job: int, timeout: float, on_poll=None) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = job_info(job)
        if on_poll is not None:
            on_poll(info)
        if info.get("JobState") in TERMINAL:
            return info
        time.sleep(1.0)
    subprocess.run(["scancel", str(job)], timeout=20)
    raise AssertionError(f"job {job} did not finish within {timeout:.0f} s (last state {job_info(job)})")


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    assert path.is_file(), f"{path} was not written"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def comparable(records: list[dict]) -> list[dict]:
    """Records without the fields that measure wall time or throughput (they differ between two runs)."""
    from mcpo_megatron.trainer.metrics import is_measurement_key

    return [{k: v for k, v in r.items() if not is_measurement_key(k)} for r in records]


def tail(path: Path, n: int = 6000) -> str:
    try:
        return Path(path).read_text(errors="replace")[-n:]   # ranks' progress bars may split a character
    except OSError as e:
        return f"<cannot read {path}: {e}>"


def python() -> str:
    return sys.executable


def metric_diff(a: list[dict], b: list[dict]) -> str:
    """The fields that differ between two comparable metric lists, step by step (for assertion messages)."""
    lines = [f"{len(a)} vs {len(b)} records"]
    for x, y in zip(a, b):
        keys = sorted(k for k in set(x) | set(y) if x.get(k) != y.get(k))
        if keys:
            lines.append(f"step {x.get('step')}: " + ", ".join(f"{k}: {x.get(k)!r} != {y.get(k)!r}" for k in keys[:12]))
    return "\n".join(lines)
