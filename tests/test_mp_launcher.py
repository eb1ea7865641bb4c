"""tests/mp.run_ranks, the multi-process tests' launcher: torchrun's worker environment and failure rule."""

import time

import pytest

from mp import run_ranks

WORKER = """
import os, sys, time
rank = int(os.environ["RANK"])
print(rank, os.environ["LOCAL_RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_WORLD_SIZE"],
      os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"], os.environ["OMP_NUM_THREADS"], sys.argv[1:])
print(f"err {rank}", file=sys.stderr)
if sys.argv[1] == "fail" and rank == 1:
    sys.exit(3)
if sys.argv[1] in ("fail", "sleep"):
    time.sleep(600)  # stopped once rank 1 has failed, or at the timeout
"""


@pytest.fixture
def worker(tmp_path):
    path = tmp_path / "worker.py"
    path.write_text(WORKER)
    return path


def test_every_rank_gets_the_launcher_environment(worker):
    proc = run_ranks(worker, 3, ["ok", 7], timeout=60)
    rows = [line.split(" ", 6) for line in proc.stdout.splitlines()]
    assert [r[:4] for r in rows] == [[str(r), str(r), "3", "3"] for r in range(3)]  # in rank order
    assert len({r[5] for r in rows}) == 1 and rows[0][4] == "127.0.0.1"  # one store, on rank 0's port
    assert all(r[6] == "1 ['ok', '7']" for r in rows)
    assert proc.stderr.splitlines() == ["err 0", "err 1", "err 2"] and proc.returncode == 0


def test_one_failed_rank_stops_the_others(worker):
    t0 = time.monotonic()
    proc = run_ranks(worker, 2, ["fail"], timeout=120, check=False)
    assert proc.returncode == 3 and time.monotonic() - t0 < 30
    with pytest.raises(AssertionError, match=r"exited with \[-15, 3\]"):
        run_ranks(worker, 2, ["fail"], timeout=120)


def test_a_timeout_stops_every_rank(worker):
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match="ran past 1s"):
        run_ranks(worker, 2, ["sleep"], timeout=1)
    assert time.monotonic() - t0 < 30
