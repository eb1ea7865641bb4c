"""A 2-point sweep (1 and 2 emulated nodes) of the CPU default (with the tiny model) through nemo-run on a real
SLURM cluster, then `mcpo report` on its output. Needs a cluster with at least 2 nodes (CI: LOCAL_SLURM_NODES=2
../shared/tools/local-slurm/start.sh); skipped with the reason otherwise."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# A few steps of the CPU default with the tiny model made by code (the sweep's launch, layouts and report are
# under test, not the model: with SmolLM2 the test took 108 s, with it 26 s): TP=1 so that 1 rank per node makes
# world sizes 1 (1 node) and 2 (2 nodes, DP=2).
OVERRIDES = ["model.path=builtin:tiny-qwen3", "trainer.total_steps=2", "data.train_batch_size=2",
             "algorithm.mini_batch_size=2", "rollout.n=2", "rollout.max_new_tokens=8", "data.max_response_length=8",
             "parallelism.tensor_model_parallel_size=1", "checkpoint.interval=0", "logging.tensorboard=false",
             "rollout.engine=torch"]


def _cluster_nodes() -> tuple[int, str]:
    """(usable nodes, reason when unusable)."""
    if shutil.which("sinfo") is None:
        return 0, "no SLURM client (sinfo) on PATH"
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%D %t"], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return 0, "sinfo timed out: no SLURM controller reachable"
    if out.returncode != 0:
        return 0, f"sinfo failed (no SLURM cluster reachable): {out.stderr.strip()[:200]}"
    nodes = sum(int(line.split()[0]) for line in out.stdout.splitlines()
                if line.strip() and not line.split()[1].startswith(("down", "drain", "fail")))
    return nodes, "" if nodes >= 2 else f"the cluster has {nodes} usable node(s); this test needs 2 " \
                                        "(LOCAL_SLURM_NODES=2)"


@pytest.mark.slurm
@pytest.mark.timeout(1800)
def test_two_point_sweep_and_report(tmp_path):
    nodes, reason = _cluster_nodes()
    if nodes < 2:
        pytest.skip(reason)
    sweep_dir = tmp_path / "sweep"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "launch.sweep", "--config", "configs/cpu_smollm2_arith.yaml", "--nodes", "1,2",
           "--executor", "slurm", "--gpus-per-node", "1", "--no-gpus", "--time", "00:30:00",
           "--sweep-dir", str(sweep_dir), "--job-dir", str(tmp_path / "nemo-run"), *OVERRIDES]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1700)
    logs = "\n".join(f"--- {p}\n{p.read_text()[-3000:]}" for p in sorted((tmp_path / "nemo-run").rglob("*.out"))
                     + sorted((tmp_path / "nemo-run").rglob("*.err")) if p.is_file())
    assert proc.returncode == 0, f"sweep failed:\n{proc.stdout}\n{proc.stderr}\n{logs}"
    assert "nodes-1: SUCCEEDED" in proc.stdout and "nodes-2: SUCCEEDED" in proc.stdout

    for label, world in (("nodes-1", 1), ("nodes-2", 2)):
        run_dir = sweep_dir / label
        point = json.loads((run_dir / "sweep_point.json").read_text())
        assert point["nodes"] == world and point["world_size"] == world
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
        assert [r["step"] for r in records] == [1, 2]
        assert all(0.0 <= r["acc/mean"] <= 1.0 and r["time/step"] > 0 for r in records)

    out = tmp_path / "report"
    rep = subprocess.run([sys.executable, "-m", "mcpo_megatron.cli", "report", str(sweep_dir), "--out", str(out),
                          "--title", "CPU sweep (SLURM, emulated nodes)"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    assert rep.returncode == 0, rep.stderr
    md = (out / "report.md").read_text()
    rows = [line for line in md.splitlines() if line.startswith("| nodes=")]
    assert any(line.startswith("| nodes=1 | 1 | 1 |") for line in rows), md
    assert any(line.startswith("| nodes=2 | 2 | 2 |") for line in rows), md
    for name in ("reward_acc.png", "mastery.png", "throughput_vs_nodes.png", "time_split.png"):
        assert (out / name).stat().st_size > 5000, name
