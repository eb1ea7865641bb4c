"""Tests that need CUDA (marker ``gpu``; skipped with that reason on CPU machines): the NCCL paths with 2 ranks,
bf16 policy parity on GPUs, and ``mcpo selftest``'s GPU checks (Transformer Engine layers among them).

    pytest -m gpu            # on a GPU node (2 GPUs for the 2-rank tests)
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "policy"))
from mp import REPO_ROOT, run_ranks  # noqa: E402

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.gpu


def needs_gpus(n: int):
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return pytest.mark.skipif(count < n, reason=f"needs {n} CUDA GPU(s); this machine has {count}")


@needs_gpus(2)
def test_collectives_on_the_default_backend_map_with_two_ranks(tmp_path):
    """CPU tensors (flags, counters, metric sums) and CUDA tensors in the same collectives of one job."""
    from mcpo_megatron.models.tiny import make_tiny_hf_model

    model_dir = make_tiny_hf_model("qwen3", tmp_path / "qwen3", seed=3)
    run_ranks(HERE / "worker_nccl.py", 2, [tmp_path, model_dir], timeout=600)
    res = json.loads((tmp_path / "nccl.json").read_text())
    assert res["backend"] == "cpu:gloo,cuda:nccl" and res["device"].startswith("cuda")
    assert res["cpu_sum"] == 3.0 and res["cpu_max"] == 1 and res["cuda_sum"] == 3.0
    assert res["cuda_broadcast"] == 6.0 and res["cuda_gather"] == [0.0, 2.0] and res["cpu_gather"] == [0.0, 3.0]
    assert res["objects"] == [{"rank": 0}, {"rank": 1}] and res["stop_agreed"] is True
    assert res["peak_memory_bytes"] > 0
    assert res["step"]["skipped"] == 0.0 and math.isfinite(res["step"]["grad_norm"])
    assert res["reshard_gbps"] > 0 and res["samples"] == 4


@needs_gpus(2)
def test_bf16_policy_parity_on_gpus(tmp_path):
    """The bf16 parity checks of tests/policy/test_policy_bf16.py, on two GPUs over NCCL."""
    from test_policy_bf16 import check_bf16_logprobs, check_bf16_step, run_bf16_worker

    res, hf = run_bf16_worker(tmp_path)
    check_bf16_logprobs(res, hf)
    check_bf16_step(res, hf)


@needs_gpus(1)
def test_selftest_passes_on_this_gpu_node(tmp_path):
    """mcpo selftest on every GPU of this node: CUDA, NCCL, TE vs local spec vs transformers (bf16), the engine
    after a reshard, a training step's MFU and its peak memory against mcpo plan."""
    out = tmp_path / "selftest.json"
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.run([sys.executable, "-m", "mcpo_megatron.cli", "selftest", "--json", str(out)], cwd=REPO_ROOT,
                          env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
    checks = {c["name"]: c for c in json.loads(out.read_text())["checks"]}
    assert checks["cuda"]["status"] == "pass" and checks["memory"]["status"] == "pass"
    assert checks["train_step"]["data"]["tokens_per_s"] > 0
    # Qwen3.5's Gated DeltaNet through flash-linear-attention's Triton kernels when the gpu extra put them here
    import importlib.util

    want = "pass" if importlib.util.find_spec("fla") is not None else "skip"
    assert checks["hybrid_layers"]["status"] == want, checks["hybrid_layers"]
