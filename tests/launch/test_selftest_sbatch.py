"""slurm/selftest.sbatch on a real SLURM cluster: two nodes x one task (the collectives cross nodes), the CPU
subset of the checks, one JSON of results."""

from __future__ import annotations

import json

import pytest
from slurm_utils import sbatch, tail, wait_job

pytestmark = pytest.mark.slurm


def test_selftest_sbatch_two_nodes(slurm, tmp_path):
    if slurm["nodes"] < 2:
        pytest.skip(f"the cluster has {slurm['nodes']} node; start it with LOCAL_SLURM_NODES=2 for this test")
    out = tmp_path / "selftest.out"
    job = sbatch("selftest.sbatch", ["--job-name=mcpo-selftest", "--nodes=2", "--ntasks-per-node=1",
                                     "--gpus-per-node=0", f"--export=ALL,RUN_DIR={tmp_path / 'run'}"], [], out)
    info = wait_job(job, 900)
    assert info["JobState"] == "COMPLETED", tail(out)
    log = out.read_text()
    assert "2 node(s) x 1 ranks" in log and "selftest passed" in log and "| collectives | PASS |" in log
    report = json.loads((tmp_path / "run" / "selftest.json").read_text())
    checks = {c["name"]: c for c in report["checks"]}
    assert report["world_size"] == 2 and checks["collectives"]["data"]["exact"]
    assert checks["engine"]["status"] == "pass" and checks["cuda"]["status"] == "skip"
