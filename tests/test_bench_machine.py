"""Every benchmark names the machine (CPU model, GPU) above its table: engine and kernel ratios depend on it."""

from __future__ import annotations

import ast
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
sys.path.insert(0, str(BENCH))
import machine  # noqa: E402


def _cpuinfo_model():
    """The CPU model as Linux reports it (the project runs on Linux: CI, SLURM clusters)."""
    return next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name"))


def test_describe_names_the_cpu_model_and_the_gpus(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert machine.describe() == f"machine: CPU {_cpuinfo_model()} ({os.cpu_count()} cores), GPU none"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "NVIDIA H100 80GB HBM3")
    assert machine.describe().endswith("GPU NVIDIA H100 80GB HBM3 x 2")


@pytest.mark.parametrize("script", sorted(p.name for p in BENCH.glob("bench_*.py")))
def test_every_benchmark_prints_the_machine(script):
    tree = ast.parse((BENCH / script).read_text())
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "describe"]
    imports = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "machine"]
    assert calls and imports, f"{script} does not print machine.describe() with its table"

