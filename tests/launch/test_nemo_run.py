"""launch/run.py: the nemo-run launcher submits the trainer through SlurmExecutor (local tunnel) to a real
cluster, or runs it with LocalExecutor + torchrun, and reports the job's final state in its exit code."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from slurm_utils import CPU_CONFIG, REPO, TINY, env, python, read_metrics

STEPS = 2


def _launch(tmp: Path, executor_args: list[str], overrides: list[str], timeout: float = 900):
    cmd = [python(), "-m", "launch.run", "--config", CPU_CONFIG, *executor_args, "--job-dir", str(tmp / "nemo"),
           *TINY, *overrides]
    return subprocess.run(cmd, cwd=REPO, env=env(), text=True, capture_output=True, timeout=timeout)


@pytest.mark.slurm
def test_slurm_executor_runs_trainer_and_reports_success(slurm, tiny_model, tmp_path):
    nodes = 2 if slurm["nodes"] >= 2 else 1
    run_dir = tmp_path / "run (a|b)"   # the sbatch script's shell must see it quoted once
    r = _launch(tmp_path, ["--executor", "slurm", "--tunnel", "local", "--nodes", str(nodes),
                           "--gpus-per-node", str(2 // nodes), "--no-gpus", "--time", "00:20:00"],
                [*tiny_model, f"trainer.total_steps={STEPS}", f"trainer.output_dir={run_dir}"])
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "job mcpo-train: SUCCEEDED" in r.stdout
    assert [rec["step"] for rec in read_metrics(run_dir)] == list(range(1, STEPS + 1))
    # nemo-run keeps its experiment under <job-dir>/experiments
    assert any((tmp_path / "nemo" / "experiments").rglob("*_sbatch.sh"))


@pytest.mark.slurm
def test_slurm_executor_failed_job_exits_nonzero(slurm, tiny_model, tmp_path):
    # passes the launcher's checks but fails in the job (the trainer validates the config on every rank)
    r = _launch(tmp_path, ["--executor", "slurm", "--nodes", "1", "--gpus-per-node", "1", "--no-gpus",
                           "--time", "00:10:00"],
                [*tiny_model, "trainer.total_steps=0", f"trainer.output_dir={tmp_path / 'run'}"])
    assert r.returncode == 1, r.stdout[-4000:] + r.stderr[-4000:]
    assert "FAILED" in r.stdout + r.stderr


@pytest.mark.multiproc
def test_local_executor_torchrun(tiny_model, tmp_path):
    # an override the shell would split: torchx's local scheduler runs no shell, so it must arrive unquoted
    run_dir = tmp_path / "run (a|b)"
    r = _launch(tmp_path, ["--executor", "local", "--gpus-per-node", "2"],
                [*tiny_model, f"trainer.total_steps={STEPS}", f"trainer.output_dir={run_dir}"])
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "job mcpo-train: SUCCEEDED" in r.stdout
    assert [rec["step"] for rec in read_metrics(run_dir)] == list(range(1, STEPS + 1))


@pytest.mark.multiproc
def test_local_executor_with_a_rollout_rank(tiny_model, tmp_path):
    """--rollout-ranks 1: of torchrun's 2 processes one trains (TP=1) and one runs the engine, one step apart."""
    run_dir = tmp_path / "run"
    r = _launch(tmp_path, ["--executor", "local", "--gpus-per-node", "2", "--rollout-ranks", "1"],
                [*tiny_model, "parallelism.tensor_model_parallel_size=1", "trainer.max_staleness=1",
                 f"trainer.total_steps={STEPS}", f"trainer.output_dir={run_dir}"])
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    records = read_metrics(run_dir)
    assert [rec["async/staleness_max"] for rec in records] == [0, 1]
    assert "rollout.placement=separate rollout.ranks=1" in r.stdout


def test_help_and_bad_arguments():
    r = subprocess.run([python(), "-m", "launch.run", "--help"], cwd=REPO, text=True, capture_output=True,
                       timeout=60)
    assert r.returncode == 0 and "--executor" in r.stdout and "--tunnel" in r.stdout
    r = subprocess.run([python(), "-m", "launch.run", "--config", CPU_CONFIG, "--executor", "local", "--nodes",
                        "2"], cwd=REPO, text=True, capture_output=True, timeout=60)
    assert r.returncode == 2 and "--nodes=2" in r.stderr
    r = subprocess.run([python(), "-m", "launch.run", "--config", "configs/nope.yaml"], cwd=REPO, text=True,
                       capture_output=True, timeout=60)
    assert r.returncode == 2 and "no such file" in r.stderr
    r = subprocess.run([python(), "-m", "launch.run", "--config", CPU_CONFIG, "--executor", "local",
                        "--gpus-per-node", "2", "--rollout-ranks", "2"], cwd=REPO, text=True, capture_output=True,
                       timeout=60)
    assert r.returncode == 2 and "--rollout-ranks=2 must leave ranks to train: 1 to 1" in r.stderr
    r = subprocess.run([python(), "-m", "launch.run", "--config", CPU_CONFIG, "--nodes", "2",
                        "--rollout-nodes", "2"], cwd=REPO, text=True, capture_output=True, timeout=60)
    assert r.returncode == 2 and "--rollout-nodes=2 must leave nodes to train: 1 to 1 of --nodes=2" in r.stderr


@pytest.mark.parametrize("gpus_per_node, preset, expected", [(1, None, 8), (2, None, 4), (3, None, 2), (16, None, 1),
                                                              (1, "3", 3)])
def test_local_executor_shares_the_cores(monkeypatch, gpus_per_node, preset, expected):
    """Each local process gets an equal share of the cores, as `mcpo train` gives them, unless OMP_NUM_THREADS
    is set (a single process on a CPU machine ran on one core before)."""
    from launch import run as launch_run

    monkeypatch.setattr(launch_run.os, "cpu_count", lambda: 8)
    if preset is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", preset)
    args = launch_run.build_parser().parse_args(["--config", CPU_CONFIG, "--executor", "local",
                                                 "--gpus-per-node", str(gpus_per_node)])
    executor, _, _ = launch_run.make_local_executor(args)
    assert executor.env_vars["OMP_NUM_THREADS"] == str(expected)


def _dry_run_sbatch_script(monkeypatch, tmp_path, argv: list[str]) -> str:
    """The sbatch script ``python -m launch.run ... --dryrun`` generates (nemo-run deletes it after a dry run
    unless told otherwise)."""
    import nemo_run

    from launch import run as launch_run

    dryrun = nemo_run.Experiment.dryrun
    monkeypatch.setattr(nemo_run.Experiment, "dryrun",
                        lambda self, log=True: dryrun(self, log=False, delete_exp_dir=False))
    with open(os.devnull) as stdin:
        monkeypatch.setattr("sys.stdin", stdin)   # nemo-run's local tunnel reads it; pytest's would refuse
        assert launch_run.main(["--config", CPU_CONFIG, "--executor", "slurm", "--job-dir", str(tmp_path / "nemo"),
                                "--dryrun", *argv]) == 0
    (script,) = (tmp_path / "nemo").rglob("*_sbatch.sh")
    return script.read_text()


def test_slurm_environment_values_reach_the_ranks_as_given(monkeypatch, tmp_path):
    """--env values (and the repository path) are exported by the generated sbatch script: each is quoted for
    its shell, so a space does not cut the value and $(...) or `...` is not run on the node."""
    marker = tmp_path / "ran"
    values = {"SPACED": "a b  c", "SUBST": f"$(touch {marker})", "BACKTICK": f"`touch {marker}`",
              "QUOTES": "it's \"quoted\"", "VAR": "$HOME;exit 3", "EMPTY": ""}
    script = _dry_run_sbatch_script(monkeypatch, tmp_path, [f"--env={k}={v}" for k, v in values.items()])
    exports = "\n".join(line for line in script.splitlines() if line.startswith("export "))
    shown = "printf '%s\\0' " + " ".join(f'"${k}"' for k in [*values, "MCPO_REPO"])
    out = subprocess.run(["bash", "-c", exports + "\n" + shown], capture_output=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.decode().split("\0")[:-1] == [*values.values(), str(REPO)]
    assert not marker.exists()


def test_environment_names_are_checked(tmp_path):
    r = subprocess.run([python(), "-m", "launch.run", "--config", CPU_CONFIG, "--dryrun", "--job-dir",
                        str(tmp_path), "--env", "A B=1",
                        "--env", "lower=1", "--env", "OK=1"], cwd=REPO, text=True, capture_output=True,
                       stdin=subprocess.DEVNULL, timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "--env 'A B=1': 'A B' is not an environment variable name" in r.stderr
    assert ("--env 'lower=1': the SLURM script nemo-run writes exports it as LOWER; write the name in capitals"
            in r.stderr)
    assert "OK=1" not in r.stderr
