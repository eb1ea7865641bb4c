"""bench/bench_reshard.py's choice of ranks (its run at a tiny size: tests/test_bench_smoke.py)."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
import bench_reshard  # noqa: E402


def test_default_tp_is_one_rank_per_gpu_at_most_two():
    assert [bench_reshard.default_tp(g) for g in (0, 1, 2, 8)] == [2, 1, 2, 2]
