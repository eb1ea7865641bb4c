"""Two runs in one output directory: trainer rank 0 holds a lock on it for the run's life; a second run is refused
naming the holder, on every rank; the lock goes with the holder's process (a killed job never blocks its requeue),
and a requeue of the same SLURM job waits for its previous attempt's lock."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mp import REPO_ROOT, run_ranks  # noqa: E402

from mcpo_megatron.config import load_config  # noqa: E402
from mcpo_megatron.parallel.distributed import ParallelInfo  # noqa: E402
from mcpo_megatron.trainer import loop, run_dir  # noqa: E402
from mcpo_megatron.trainer.checkpoint import CheckpointManager  # noqa: E402

INFO = ParallelInfo(rank=0, world_size=1, local_rank=0, tp=1, pp=1, dp=1, tp_rank=0, pp_rank=0, dp_rank=0,
                    is_first_stage=True, is_last_stage=True, tp_group=None, pp_group=None, dp_group=None,
                    device=torch.device("cpu"))


class Reached(Exception):
    pass


def _holder(directory, job_id="7001"):
    """Another process, as a running job's rank 0 would: locks ``directory``, says so, and waits."""
    code = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from mcpo_megatron.trainer.run_dir import lock_dir
        lock_dir(Path({str(directory)!r}))
        print("locked", flush=True)
        time.sleep(600)
    """)
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), SLURM_JOB_ID=job_id, SLURM_RESTART_COUNT="0")
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def _kill(proc):
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)


def _train_until_setup(cfg, monkeypatch):
    def reached(*_a, **_k):
        raise Reached

    monkeypatch.setattr(loop, "build_setup", reached)
    with pytest.raises(Reached):
        loop.train(cfg, INFO)


def test_a_second_run_is_refused_naming_the_holder_until_the_holder_dies(tmp_path, monkeypatch):
    out = tmp_path / "run"
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    holder = _holder(out)
    try:
        cfg = load_config(None, [f"trainer.output_dir={out}", "trainer.resume=auto"])
        with pytest.raises(run_dir.RunDirInUse) as e:
            loop.train(cfg, INFO)
        msg = str(e.value)
        assert f"trainer.output_dir={out} is in use by another run" in msg
        assert f"host {socket.gethostname()}, pid {holder.pid}, SLURM job 7001" in msg
        assert "scancel 7001" in msg and "another trainer.output_dir" in msg
        # overwrite never moves a running run's directory aside
        (out / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
        with pytest.raises(run_dir.RunDirInUse):
            loop.train(load_config(None, [f"trainer.output_dir={out}", "trainer.resume=never",
                                          "trainer.overwrite=true"]), INFO)
        assert (out / "metrics.jsonl").is_file() and not list(tmp_path.glob("run.replaced-*"))
    finally:
        _kill(holder)
    # SIGKILL leaves no chance to clean up: the kernel drops the lock with the process, so the requeue starts.
    _train_until_setup(cfg, monkeypatch)
    # ... and gave it back when train() ended: the lock file names the last holder, this process.
    assert json.loads((out / run_dir.LOCK_FILE).read_text())["pid"] == os.getpid()
    run_dir.lock_dir(out).release()


def test_a_checkpoint_dir_outside_the_output_dir_is_locked_too(tmp_path, monkeypatch):
    out, ckpt = tmp_path / "run", tmp_path / "ckpt"
    holder = _holder(ckpt)
    try:
        cfg = load_config(None, [f"trainer.output_dir={out}", f"checkpoint.dir={ckpt}", "trainer.resume=auto"])
        with pytest.raises(run_dir.RunDirInUse, match=f"checkpoint.dir={ckpt} is in use"):
            loop.train(cfg, INFO)
    finally:
        _kill(holder)
    run_dir.lock_dir(out).release()  # the output directory's lock was given back on the refusal


def test_a_requeue_of_the_same_slurm_job_waits_for_its_previous_attempt(tmp_path, monkeypatch):
    out = tmp_path / "run"
    holder = _holder(out, job_id="7002")
    monkeypatch.setenv("SLURM_JOB_ID", "7002")
    try:
        with pytest.raises(run_dir.RunDirInUse, match=r"requeue of the same job: it waited 1 s"):
            run_dir.lock_dir(out, requeue_wait_s=1.0, poll_s=0.2)  # the previous attempt lives on: refused
        threading.Timer(1.0, _kill, args=(holder,)).start()  # ... until it dies
        t0 = time.monotonic()
        run_dir.lock_dir(out, requeue_wait_s=60.0, poll_s=0.2).release()
        assert 0.8 < time.monotonic() - t0 < 30
    finally:
        if holder.poll() is None:
            _kill(holder)


def test_a_file_system_without_locks_warns_and_goes_on(tmp_path, monkeypatch, capsys):
    import errno
    import fcntl

    def no_locks(*_a):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "lockf", no_locks)
    lock = run_dir.lock_dir(tmp_path / "run")
    assert lock.fd is None
    err = capsys.readouterr().err
    assert f"cannot lock {tmp_path / 'run' / run_dir.LOCK_FILE} (No locks available)" in err
    assert "a second run started in this directory would not be refused" in err


def test_overwrite_moves_the_old_run_and_locks_the_new_directory(tmp_path, monkeypatch):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    held = []

    def probe(*_a, **_k):  # while the run sets up, another process cannot lock its directory
        code = (f"from pathlib import Path; from mcpo_megatron.trainer.run_dir import lock_dir; "
                f"lock_dir(Path({str(out)!r}))")
        held.append(subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)),
                                   capture_output=True, text=True).stderr)
        raise Reached

    monkeypatch.setattr(loop, "build_setup", probe)
    with pytest.raises(Reached):
        loop.train(load_config(None, [f"trainer.output_dir={out}", "trainer.resume=never", "trainer.overwrite=true"]),
                   INFO)
    assert "RunDirInUse" in held[0] and f"pid {os.getpid()}" in held[0]
    assert len(list(tmp_path.glob("run.replaced-*"))) == 1
    run_dir.lock_dir(out).release()


@pytest.mark.multiproc
def test_every_rank_gets_rank_0s_refusal_and_agrees_on_a_fallback(tmp_path, monkeypatch):
    """Two gloo ranks: rank 0's refusal reaches rank 1 (no rank waits in a collective for a rank that left), a
    checkpoint only rank 1 cannot read (its RNG file) makes both ranks fall back to the previous one, and where rank
    1's view of the checkpoints lags (it sees step 2 as the latest, rank 0 step 4) both resume rank 0's."""
    locked, resumed = tmp_path / "locked", tmp_path / "resumed"
    monkeypatch.setenv("SLURM_JOB_ID", "7003")
    lock = run_dir.lock_dir(locked)  # held by this test's process
    mgr = CheckpointManager(resumed / "checkpoints", rank=0, keep_last=3)
    for step in (2, 4):
        path = mgr.save(step, save_policy=lambda d: d.mkdir(), config_yaml="a: 1\n",
                        trainer_state={"step": step, "sampler": {"pos": step}, "tracker": {}, "in_flight": []})
        (path / "rng" / "rank_00001.pt").write_bytes((path / "rng" / "rank_00000.pt").read_bytes())
    (resumed / "checkpoints" / "step_000004" / "rng" / "rank_00001.pt").write_bytes(b"PK\x03\x04 cut short")
    views = tmp_path / "views"
    view = CheckpointManager(views / "rank0", rank=0, keep_last=3)
    for step in (2, 4):
        view.save(step, save_policy=lambda d: d.mkdir(), config_yaml="a: 1\n",
                  trainer_state={"step": step, "sampler": {"pos": step}, "tracker": {}, "in_flight": []})
        if step == 2:
            shutil.copytree(views / "rank0", views / "rank1")
    results = tmp_path / "results"
    results.mkdir()
    try:
        run_ranks(Path(__file__).parent / "workers" / "worker_run_dir_ranks.py", 2,
                  [results, locked, resumed, views], timeout=240, env={"SLURM_JOB_ID": ""})
    finally:
        lock.release()
    seen = [json.loads((results / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r in seen:
        assert r["refusal"][0] == "RunDirInUse"
        assert f"pid {os.getpid()}, SLURM job 7003" in r["refusal"][1]
        assert r["step"] == 2 and r["sampler"] == {"pos": 2} and r["policy_loaded"] == ["step_000002"]
    assert "rank_00001.pt: unreadable" in seen[0]["printed"] and "(on rank 1)" in seen[0]["printed"]
    assert "falling back to the previous complete checkpoint" in seen[0]["printed"]
    assert (resumed / "checkpoints" / "step_000004.unloadable").is_dir()
    for r in seen:
        assert r["views"] == {"step": 4, "policy_loaded": ["step_000004"], "latest_step": 4}
