"""The benchmarks' GPU branches with CUDA mocked (no GPU here): device choice, peak-memory accounting and the
fit check of bench_logprobs.py. Their runs on CPU at a tiny size: tests/test_bench_smoke.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
import bench_logprobs as L  # noqa: E402


def gpus(monkeypatch, n: int):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)


def test_device_is_the_gpu_when_there_is_one_rank_per_gpu(monkeypatch):
    gpus(monkeypatch, 1)
    assert L.resolve_device("auto", 1) == "cuda" and L.resolve_device("cpu", 1) == "cpu"
    with pytest.raises(SystemExit, match="--tp=2 needs 2 GPUs .* this machine has 1"):
        L.resolve_device("auto", 2)
    gpus(monkeypatch, 0)
    assert L.resolve_device("auto", 2) == "cpu"
    with pytest.raises(SystemExit, match="has 0"):
        L.resolve_device("cuda", 1)


def test_peak_cuda_is_the_allocator_peak_above_what_was_allocated_before(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: calls.append("sync"))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: 100)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: calls.append("reset"))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 350)
    out = {}
    with L.peak_cuda(out):
        calls.append("body")
    assert out == {"peak_bytes": 250} and calls == ["sync", "reset", "body", "sync"]


def test_a_size_the_naive_method_cannot_fit_is_refused_naming_tokens(monkeypatch):
    need = L.naive_bytes_per_rank(8192, 151936, 1)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (79 * 2**30, 80 * 2**30))
    assert need < 0.9 * 79 * 2**30
    L.check_gpu_fits(8192, 151936, 1)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (20 * 2**30, 24 * 2**30))
    with pytest.raises(SystemExit, match="--tokens=8192: .* lower --tokens"):
        L.check_gpu_fits(8192, 151936, 1)

