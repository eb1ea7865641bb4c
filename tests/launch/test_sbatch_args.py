"""slurm/train.sbatch's arguments to the ranks, without a cluster: the script runs under bash with a fake `srun`
(it records its arguments) and `scontrol` on PATH, and a stand-in for python's config check."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CONFIG = "configs/cpu_smollm2_arith.yaml"

FAKE_SRUN = """#!/bin/bash
printf '%s\\n' "$@" > "$FAKE_SRUN_ARGS"
"""
FAKE_SCONTROL = """#!/bin/bash
echo "scontrol $*" >> "$FAKE_SCONTROL_CALLS"
[ "$1 $2" = "show hostnames" ] && echo localhost
exit 0
"""


@pytest.fixture
def run_sbatch(tmp_path):
    """``run_sbatch(overrides, restart_count=0)``: the arguments train.sbatch hands `mcpo_megatron.cli train`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)

    def run(overrides: list[str], restart_count: int = 0) -> list[str]:
        args_file = tmp_path / "srun_args"
        args_file.unlink(missing_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env.update(PATH=f"{bin_dir}:{env['PATH']}", MCPO_REPO=str(REPO), MCPO_VENV="none", MCPO_PYTHON="true",
                   FAKE_SRUN_ARGS=str(args_file), FAKE_SCONTROL_CALLS=str(tmp_path / "scontrol_calls"),
                   SLURM_JOB_ID="4242", SLURM_JOB_NAME="mcpo-args", SLURM_JOB_NUM_NODES="1", GPUS_PER_NODE="2",
                   SLURM_RESTART_COUNT=str(restart_count))
        r = subprocess.run(["bash", str(REPO / "slurm" / "train.sbatch"), CONFIG, *overrides], cwd=REPO, env=env,
                           text=True, capture_output=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        args = args_file.read_text().splitlines()
        return args[args.index("train") + 1:]

    return run


def _checkpoint(root: Path, step: int) -> Path:
    path = root / f"step_{step:06d}"
    path.mkdir(parents=True)
    (path / "COMPLETE").write_text(json.dumps({"step": step}))
    return path


def _resume(args: list[str]) -> str:
    """The trainer.resume the ranks see: the last one given wins."""
    return [a for a in args if a.startswith("trainer.resume=")][-1]


def test_a_users_resume_path_is_kept(run_sbatch, tmp_path):
    start = _checkpoint(tmp_path / "other_run" / "checkpoints", 100)
    args = run_sbatch([f"trainer.output_dir={tmp_path / 'run'}", f"trainer.resume={start}"])
    assert args[0] == CONFIG
    assert _resume(args) == f"trainer.resume={start}"
    assert f"trainer.output_dir={tmp_path / 'run'}" in args


def test_without_a_users_resume_the_job_resumes_its_own_run(run_sbatch, tmp_path):
    assert _resume(run_sbatch([f"trainer.output_dir={tmp_path / 'run'}"])) == "trainer.resume=auto"
    args = run_sbatch([f"trainer.output_dir={tmp_path / 'run'}", "trainer.resume=never"])
    assert _resume(args) == "trainer.resume=never"


def test_a_requeued_job_continues_its_own_run(run_sbatch, tmp_path):
    """The user's starting checkpoint holds until the run has one of its own; never becomes auto on a requeue
    (the first attempt's step records would refuse it)."""
    start = _checkpoint(tmp_path / "other_run" / "checkpoints", 100)
    run = tmp_path / "run"
    overrides = [f"trainer.output_dir={run}", f"trainer.resume={start}"]
    assert _resume(run_sbatch(overrides, restart_count=1)) == f"trainer.resume={start}"   # none written yet
    _checkpoint(run / "checkpoints", 104)
    assert _resume(run_sbatch(overrides, restart_count=1)) == "trainer.resume=auto"
    assert _resume(run_sbatch(overrides, restart_count=0)) == f"trainer.resume={start}"   # a new submission
    own_dir = tmp_path / "ckpt"
    with_dir = [f"trainer.output_dir={tmp_path / 'run2'}", f"checkpoint.dir={own_dir}", f"trainer.resume={start}"]
    assert _resume(run_sbatch(with_dir, restart_count=2)) == f"trainer.resume={start}"
    _checkpoint(own_dir, 104)
    assert _resume(run_sbatch(with_dir, restart_count=2)) == "trainer.resume=auto"
    never = [f"trainer.output_dir={tmp_path / 'run3'}", "trainer.resume=never"]
    assert _resume(run_sbatch(never, restart_count=1)) == "trainer.resume=auto"
