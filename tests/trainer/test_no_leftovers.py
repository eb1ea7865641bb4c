"""A run whose rank dies leaves no process of its own behind.

A rank's helpers (reward workers; megatron-core's checkpoint writer starts a multiprocessing Manager server)
used to outlive a killed run, re-parented to init: torchrun signals only the process groups of workers that
are still running. Here a real 2-rank training run is started, one rank is SIGKILLed after the first
checkpoint, and every process the run had started must be gone within seconds.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_resume_e2e import REPO, _cmd, _env, _overrides  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mcpo_megatron.models.tiny import make_tiny_model_with_tokenizer  # noqa: E402

from mcpo_megatron.trainer.checkpoint import find_latest  # noqa: E402

pytestmark = pytest.mark.multiproc


def _tree(root: psutil.Process) -> dict[int, tuple[float, str]]:
    out = {}
    for p in root.children(recursive=True):
        try:
            out[p.pid] = (p.create_time(), " ".join(p.cmdline())[:160])
        except psutil.Error:
            pass
    return out


def _alive(noted: dict[int, tuple[float, str]]) -> dict[int, str]:
    out = {}
    for pid, (started, cmd) in noted.items():
        try:
            p = psutil.Process(pid)
            if p.create_time() == started and p.status() != psutil.STATUS_ZOMBIE:
                out[pid] = cmd
        except psutil.Error:
            pass
    return out


def _is_manager(cmd: str) -> bool:
    return "multiprocessing" in cmd and "spawn_main" in cmd


def test_killed_rank_leaves_no_process_behind(tmp_path):
    model = make_tiny_model_with_tokenizer(tmp_path / "model")
    out = tmp_path / "run"
    overrides = _overrides(model, out, steps=200) + ["checkpoint.interval=1"]
    noted: dict = {}
    with open(tmp_path / "run.log", "w") as log:
        launcher = subprocess.Popen(_cmd(overrides), cwd=REPO, env=_env(), stdout=log, stderr=subprocess.STDOUT)
    try:
        root = psutil.Process(launcher.pid)
        deadline = time.monotonic() + 400
        # wait for the first checkpoint: by then the reward workers and the checkpoint writer's Manager run
        while time.monotonic() < deadline and launcher.poll() is None:
            noted.update(_tree(root))
            if find_latest(out / "checkpoints") is not None and any(_is_manager(c) for _, c in _tree(root).values()):
                break
            time.sleep(0.5)
        assert launcher.poll() is None, (tmp_path / "run.log").read_text()[-4000:]
        noted.update(_tree(root))
        ranks = [p for p in root.children() if "mcpo_megatron.cli train" in " ".join(p.cmdline())]
        assert len(ranks) == 2
        assert sum(_is_manager(c) for _, c in noted.values()) >= 1, noted
        os.kill(ranks[1].pid, signal.SIGKILL)
        killed_at = time.monotonic()
        launcher.wait(timeout=120)
        left = _alive(noted)
        while left and time.monotonic() < killed_at + 60:
            time.sleep(0.5)
            left = _alive(noted)
        gone_after = time.monotonic() - killed_at
        print(f"{len(noted)} processes of the run; all gone {gone_after:.1f} s after the kill")
        assert left == {}, f"left behind: {left}"
        assert gone_after < 60
    finally:  # whatever the outcome, leave nothing running for the next tests
        if launcher.poll() is None:
            launcher.kill()
        for pid in _alive(noted):
            os.kill(pid, signal.SIGKILL)


def test_exception_mid_step_closes_everything_and_leaves_no_process(tmp_path):
    """A rank that raises mid-step closes its logger, reward pool and engine in that order (vLLM's shutdown must
    come last, before the process group is destroyed), every rank exits, and nothing the run started is left."""
    model = make_tiny_model_with_tokenizer(tmp_path / "model")
    out = tmp_path / "run"
    closes = tmp_path / "closes"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(Path(__file__).parent / "workers" / "fault_mid_step.py"), *_overrides(model, out, steps=4)]
    env = dict(_env(), MCPO_TEST_FAULT_STEP="2", MCPO_TEST_CLOSE_LOG=str(closes))
    noted: dict = {}
    with open(tmp_path / "run.log", "w") as log:
        launcher = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        root = psutil.Process(launcher.pid)
        deadline = time.monotonic() + 400
        while launcher.poll() is None and time.monotonic() < deadline:
            noted.update(_tree(root))
            time.sleep(0.2)
        assert launcher.poll() is not None, "the run did not exit after the fault"
        text = (tmp_path / "run.log").read_text()
        assert launcher.returncode != 0 and "injected fault in step 2" in text, text[-4000:]
        for rank in (0, 1):
            order = Path(f"{closes}.{rank}").read_text().split()
            assert order == ["logger", "reward_pool", "engine"], (rank, order, text[-4000:])
        assert any("reward" in c or _is_manager(c) or "spawn_main" in c for _, c in noted.values()), noted
        left = _alive(noted)
        t0 = time.monotonic()
        while left and time.monotonic() < t0 + 30:
            time.sleep(0.5)
            left = _alive(noted)
        assert left == {}, f"left behind: {left}"
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for pid in _alive(noted):
            os.kill(pid, signal.SIGKILL)
