"""Separate placement's waits across processes: 2 trainer ranks and 1 engine rank under torchrun (gloo, no model;
tests/rollout/separate/workers/worker_liveness.py). The trainer world's collective timeout is the old fixed one scaled down to
2 s.

* a slow engine that beats (3 s per batch) is waited for by both trainer ranks: the one that is not the leader
  waits in the wait group, whose timeout derives from the batch limit; in the trainer world's group, where it
  waited before, the same wait times out (the control, in the same launch);
* an engine rank that freezes is named by the leader within the heartbeat limit, the other trainer rank raises
  the same error (it arrives in the broadcast it waits in), both exit 1, and the launcher ends the frozen rank;
* a failure on the trainer leader alone (staging, a store error, a result it cannot unpickle) reaches the other
  trainer rank as the leader's verdict: both raise it, naming it, within seconds (not after the wait group's
  timeout).
"""

import json
import time
from pathlib import Path

import pytest

from mp import run_ranks

WORKER = Path(__file__).parent / "workers" / "worker_liveness.py"
pytestmark = pytest.mark.multiproc


def launch(tmp_path, scenario):
    out = tmp_path / scenario
    out.mkdir()
    t0 = time.monotonic()
    proc = run_ranks(WORKER, 3, [out, scenario], timeout=120, check=False)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) if (out / f"rank{r}.json").is_file() else None
             for r in range(2)]
    return proc, ranks, time.monotonic() - t0


def test_a_slow_engine_that_beats_is_waited_for_by_every_trainer_rank(tmp_path):
    """Batch (0, 0): both trainer ranks get the samples after 3 s, longer than the trainer world's timeout. Batch
    (1, 0), the control: the rank that is not the leader waits in the trainer world's group and times out."""
    proc, ranks, _ = launch(tmp_path, "slow")
    log = proc.stdout[-3000:] + proc.stderr[-3000:]
    for r in ranks:
        assert r["world_timeout_s"] == 2.0 and r["wait_group_timeout_s"] == 14.0, r  # 2 x 6 s + 1 s + 1 s slack
        assert r["wait_group_backend"] == "gloo"  # CPU objects, whatever the trainer world's backend
        first = r["batches"][0]
        assert "error" not in first, (first, log)
        assert first["version"] == 0 and first["samples"] == [[0, [0.0]]] * 2 + [[1, [0.0]]] * 2  # the weights sent
        assert first["waited_s"] >= 3.0
    control = ranks[1]["batches"][1]
    assert "timed out" in control.get("error", "").lower() and control["waited_s"] < 3.0, (control, log)
    assert proc.returncode != 0


def test_a_frozen_engine_rank_is_named_on_every_trainer_rank_and_the_job_ends(tmp_path):
    proc, ranks, took = launch(tmp_path, "freeze")
    assert proc.returncode != 0
    errors = [r["batches"][0]["error"] for r in ranks]
    assert errors[0] == errors[1], errors
    assert errors[0].startswith(
        "RuntimeError: the rollout ranks failed on generation batch (0, 0): engine rank 0 (launch rank 2) (silent "
        "1 s): no heartbeat for longer than rollout.heartbeat_timeout_s=1 "), errors[0]
    assert all(r["batches"][0]["waited_s"] < 1.0 + 3.0 for r in ranks), ranks  # the limit, a look, the broadcast
    assert took < 60, took  # the launcher ended the frozen engine rank once the trainer ranks failed


@pytest.mark.parametrize("scenario,named", [
    ("staging_fails", "RuntimeError: the trainer leader failed while publishing version 0: RuntimeError: staging "
                      "version 0 failed: RuntimeError: injected: page-locking the leader's copy failed"),
    ("store_fails", "RuntimeError: the trainer leader failed while waiting for generation batch (0, 0): "
                    "DistStoreError: injected: the store connection was lost"),
    ("unpickle_fails", "RuntimeError: the trainer leader failed while waiting for generation batch (0, 0): "
                       "UnpicklingError: injected: a result that cannot be read"),
])
def test_a_failure_on_the_trainer_leader_alone_ends_every_trainer_rank_with_its_error(tmp_path, scenario, named):
    proc, ranks, took = launch(tmp_path, scenario)
    log = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode != 0
    assert all(r is not None for r in ranks), log
    errors = [r["batches"][0].get("error") for r in ranks]
    assert errors == [named, named], (errors, log)
    # the other rank learns it in the broadcast it waits in, not when the wait group's 14 s timeout ends it
    assert all(r["batches"][0]["waited_s"] < 5.0 for r in ranks), ranks
    assert took < 60, took
