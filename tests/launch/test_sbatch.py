"""slurm/train.sbatch on a real SLURM cluster: 1 node x 2 tasks, a resume path on the command line, and the
engines on a node of their own. Multi-node training, preemption (USR1 -> checkpoint -> scontrol requeue -> resume,
with the metrics of an uninterrupted run), export.sbatch and eval.sbatch run in every recipe's rehearsal
(test_rehearsal_sbatch.py)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from mcpo_megatron.trainer.checkpoint import list_complete
from slurm_utils import CPU_CONFIG, TINY, read_metrics, sbatch, tail, wait_job

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
