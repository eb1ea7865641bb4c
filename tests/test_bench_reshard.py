"""bench/bench_reshard.py's arguments (its run at a tiny size: tests/test_bench_smoke.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
import bench_reshard  # noqa: E402


def test_layouts_are_checked_before_any_process_starts(capsys):
    with pytest.raises(SystemExit):
        bench_reshard.parse_args(["--layouts", "tp2,tp3"])
    assert "--layouts: unknown ['tp3']; choose from tp1, tp2, pp2, ep2, vllm" in capsys.readouterr().err
    assert bench_reshard.parse_args([]).layouts.split(",") == list(bench_reshard.LAYOUTS)
