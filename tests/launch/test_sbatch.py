"""slurm/train.sbatch on a real SLURM cluster: 1 node x 2 tasks, 2 nodes x 1 task, and preemption
(USR1 -> checkpoint -> scontrol requeue -> resume) giving the metrics of an uninterrupted run."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
from mcpo_megatron.trainer.checkpoint import list_complete
from slurm_utils import CPU_CONFIG, TINY, comparable, job_info, metric_diff, read_metrics, sbatch, tail, wait_job

pytestmark = pytest.mark.slurm

STEPS = 4
JOB_TIMEOUT = 900


def _train(tmp: Path, name: str, sbatch_args: list[str], model: list[str], steps: int = STEPS):
    run_dir, out = tmp / name, tmp / f"{name}.out"
    job = sbatch("train.sbatch", [f"--job-name={name}", "--gpus-per-node=0", *sbatch_args],
                 [CPU_CONFIG, *model, *TINY, f"trainer.total_steps={steps}", f"trainer.output_dir={run_dir}"], out)
    return job, run_dir, out


@pytest.fixture(scope="module")
def one_node(slurm, tiny_model, tmp_path_factory):
    """The uninterrupted reference: 1 node x 2 tasks."""
    if slurm["cpus"] < 2:
        pytest.skip(f"the cluster's nodes have {slurm['cpus']} CPU(s); 2 tasks on one node need 2")
    tmp = tmp_path_factory.mktemp("sbatch1")
    t0 = time.monotonic()
    job, run_dir, out = _train(tmp, "mcpo-1node", ["--nodes=1", "--ntasks-per-node=2"], tiny_model)
    info = wait_job(job, JOB_TIMEOUT)
    return dict(job=job, run_dir=run_dir, out=out, info=info, wall=time.monotonic() - t0)


def test_train_sbatch_one_node_two_tasks(one_node):
    r = one_node
    assert r["info"]["JobState"] == "COMPLETED", tail(r["out"])
    log = r["out"].read_text()
    assert "resolved config" in log and "config OK" in log          # printed before the ranks start
    assert "1 node(s) x 2 ranks" in log
    records = read_metrics(r["run_dir"])
    assert [rec["step"] for rec in records] == list(range(1, STEPS + 1)), records
    assert all("reward/mean" in rec for rec in records)
    assert [step for step, _ in list_complete(r["run_dir"] / "checkpoints")] == [STEPS]   # the final one
    # the per-job log copy next to the metrics
    assert (r["run_dir"] / "logs" / f"mcpo-1node-{r['job']}.log").is_file()


def test_train_sbatch_two_nodes(slurm, tiny_model, tmp_path, one_node):
    if slurm["nodes"] < 2:
        pytest.skip(f"the cluster has {slurm['nodes']} node; start it with LOCAL_SLURM_NODES=2 for this test")
    job, run_dir, out = _train(tmp_path, "mcpo-2node", ["--nodes=2", "--ntasks-per-node=1"], tiny_model)
    info = wait_job(job, JOB_TIMEOUT)
    assert info["JobState"] == "COMPLETED", tail(out)
    log = out.read_text()
    assert "2 node(s) x 1 ranks" in log
    # same program, same seed, same world size: the same metrics as on one node
    got, want = comparable(read_metrics(run_dir)), comparable(read_metrics(one_node["run_dir"]))
    assert got == want, metric_diff(got, want)


def test_preemption_checkpoints_requeues_and_resumes(slurm, tiny_model, tmp_path, one_node):
    """USR1 to the batch shell (what `#SBATCH --signal=B:USR1@T` does before the time limit) once step 1 is
    logged: the ranks finish their step, checkpoint and exit 0, the script requeues the job (same id, same run
    directory), the requeued job resumes from `latest` and ends with the uninterrupted run's metrics."""
    job, run_dir, out = _train(tmp_path, "mcpo-preempt", ["--nodes=1", "--ntasks-per-node=2"], tiny_model)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + JOB_TIMEOUT
    while not (metrics.is_file() and metrics.read_text().strip()):
        assert time.monotonic() < deadline, "no step was logged:\n" + tail(out)
        state = job_info(job).get("JobState")
        assert state in ("PENDING", "RUNNING", "CONFIGURING"), f"job ended early ({state}):\n{tail(out)}"
        time.sleep(0.5)
    subprocess.run(["scancel", "--batch", "--signal=USR1", str(job)], check=True, timeout=30)

    # slurmd refuses to start the requeued batch job until the revoked launch credential of its previous run
    # expires (about 120 s): forcing an earlier start ("StartTime=now") fails it with "Job credential revoked".
    info = wait_job(job, JOB_TIMEOUT)
    log = out.read_text()
    assert info["JobState"] == "COMPLETED", log[-6000:]
    assert int(info.get("Restarts", 0)) == 1, info
    assert "USR1 received" in log and "checkpoint written after the signal" in log, log[-6000:]
    assert "requeueing job" in log and "attempt 2" in log, log[-6000:]
    assert not (run_dir / "PREEMPTED").exists()       # the requeued attempt removed the marker
    # the checkpoint written on the signal (interval=100: no periodic one) and the final one
    saved = [step for step, _ in list_complete(run_dir / "checkpoints")]
    assert len(saved) == 2 and 1 <= saved[0] < STEPS and saved[1] == STEPS, saved
    records = read_metrics(run_dir)
    steps = [r["step"] for r in records]
    assert steps == list(range(1, STEPS + 1)), f"steps logged {steps} (a step was lost or repeated)"
    got, want = comparable(records), comparable(read_metrics(one_node["run_dir"]))
    assert got == want, metric_diff(got, want)


def test_resume_path_on_the_command_line_is_honoured(slurm, tiny_model, tmp_path, one_node):
    """trainer.resume=<a run's checkpoints/> starts a new run directory from that run's latest checkpoint (the
    script used to append trainer.resume=auto after it, so the job began from the base weights at step 1)."""
    start = one_node["run_dir"] / "checkpoints"
    job, run_dir, out = _train(tmp_path, "mcpo-from", ["--nodes=1", "--ntasks-per-node=2"],
                               [*tiny_model, f"trainer.resume={start}"], steps=STEPS + 1)
    info = wait_job(job, JOB_TIMEOUT)
    assert info["JobState"] == "COMPLETED", tail(out)
    log = out.read_text(errors="replace")   # two ranks' progress bars can interleave inside a character
    assert f"resumed from {start / f'step_{STEPS:06d}'} at step {STEPS}" in log, tail(out)
    assert [r["step"] for r in read_metrics(run_dir)] == [STEPS + 1]


def test_export_sbatch_exports_the_trained_checkpoint(slurm, tmp_path, one_node):
    """slurm/export.sbatch runs `mcpo export` on the 1-node run's TP=2 checkpoint: an srun task per rank of the
    checkpoint's layout, read from the checkpoint."""
    out_dir, log = tmp_path / "hf", tmp_path / "export.out"
    job = sbatch("export.sbatch", ["--job-name=mcpo-export", "--gpus-per-node=0", "--ntasks-per-node=2"],
                 ["--checkpoint", str(one_node["run_dir"] / "checkpoints"), "--out", str(out_dir)], log)
    info = wait_job(job, JOB_TIMEOUT)
    assert info["JobState"] == "COMPLETED", tail(log)
    text = log.read_text()
    assert "was trained at TP=2 x PP=1: the export runs 2 rank(s), one per GPU" in text
    assert "1 node(s) x 2 ranks: mcpo export" in text and "parity: max |log-prob diff|" in text
    assert (out_dir / "config.json").is_file() and any(out_dir.glob("*.safetensors")), tail(log)


def test_separate_rollout_node_overlaps_and_resumes(slurm, tiny_model, tmp_path):
    """ROLLOUT_NODES=1 on 2 nodes x 1 task: the first node trains, the second runs the engine; with
    trainer.max_staleness=1 every step after the first trains on the previous version's samples. Submitted again
    with more steps, the job resumes from its last checkpoint."""
    if slurm["nodes"] < 2:
        pytest.skip(f"the cluster has {slurm['nodes']} node; start it with LOCAL_SLURM_NODES=2 for this test")
    run_dir = tmp_path / "run"
    args = [CPU_CONFIG, *tiny_model, *TINY, "parallelism.tensor_model_parallel_size=1", "trainer.max_staleness=1",
            f"trainer.output_dir={run_dir}"]
    sbatch_args = ["--job-name=mcpo-async", "--gpus-per-node=0", "--nodes=2", "--ntasks-per-node=1"]
    out = tmp_path / "async.out"
    job = sbatch("train.sbatch", sbatch_args, [*args, "trainer.total_steps=3"], out, {"ROLLOUT_NODES": "1"})
    info = wait_job(job, JOB_TIMEOUT)
    assert info["JobState"] == "COMPLETED", tail(out)
    log = out.read_text()
    assert "rollout engines on the last 1 node(s) (1 ranks), training on the first 1" in log
    assert "[rollout] served" in log
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert [r["async/staleness_max"] for r in records] == [0, 1, 1]
    # the engine loads version 0, keeps it for step 2's batch (staleness 1 allows it), loads version 1 for step 3's
    assert [r["async/weight_updates"] for r in records] == [1, 0, 1]

    out2 = tmp_path / "async2.out"
    job = sbatch("train.sbatch", sbatch_args, [*args, "trainer.total_steps=5"], out2, {"ROLLOUT_NODES": "1"})
    info = wait_job(job, JOB_TIMEOUT)
    assert info["JobState"] == "COMPLETED", tail(out2)
    assert "resumed from" in out2.read_text()
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    # the resumed engine starts from the checkpoint's weights (version 3): step 4's batch is fresh, step 5's one old
    assert [r["async/staleness_max"] for r in records[3:]] == [0, 1]


def test_rollout_nodes_must_leave_a_node_to_train(slurm, tiny_model, tmp_path):
    out = tmp_path / "bad.out"
    job = sbatch("train.sbatch", ["--job-name=mcpo-bad", "--gpus-per-node=0", "--nodes=1", "--ntasks-per-node=1"],
                 [CPU_CONFIG, *tiny_model, *TINY, f"trainer.output_dir={tmp_path / 'run'}"], out,
                 {"ROLLOUT_NODES": "1"})
    info = wait_job(job, JOB_TIMEOUT)
    assert info["JobState"] == "FAILED", tail(out)
    assert "ROLLOUT_NODES=1 must be a whole number of nodes from 1 to 0" in out.read_text()
