"""bench/bench_reshard.py runs end to end (tiny shape, its default 2 gloo ranks on CPU) and reports every row."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
import bench_reshard  # noqa: E402

pytestmark = pytest.mark.multiproc

TINY = ["--layers", "1", "--hidden", "64", "--ffn", "128", "--vocab", "256", "--repeats", "1", "--bucket-mb", "1"]


def test_bench_reshard_reports_every_row(tmp_path):
    out = tmp_path / "reshard.json"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "bench_reshard.py"), *TINY, "--json", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    paths = [r["path"] for r in res["rows"]]
    assert paths == ["TP=2 -> TP=1 gather (torch engine)", "gloo all_gather of the TP shards only",
                     "memcpy (same bytes, all ranks)"]
    # Every weight of the tied tiny Qwen3 reaches the engine in bf16: 2 bytes per parameter.
    assert res["rows"][0]["bytes"] == 2 * res["params"] and res["rows"][0]["buckets"] >= 1
    assert all(r["gbps"] > 0 and r["seconds"] > 0 for r in res["rows"])
    assert res["push_gbps"] == res["rows"][0]["gbps"] and len(res["peak_bytes"]) == 2
    assert "TP=2 -> TP=1 gather (torch engine)" in proc.stdout and "machine: CPU" in proc.stdout


def test_default_tp_is_one_rank_per_gpu_at_most_two():
    assert [bench_reshard.default_tp(g) for g in (0, 1, 2, 8)] == [2, 1, 2, 2]
