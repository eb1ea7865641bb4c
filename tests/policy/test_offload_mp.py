"""trainer.offload at the policy level (2 CPU ranks, gloo): training steps with the state moved to host memory and
back between them equal, bit for bit, the same steps without; while offloaded every storage of the state is
released (0 bytes), the weights stay while a weight update reads them, and after onload every parameter is
again a view of its DDP buffer. Three layouts: DP=2 in bf16 with the distributed optimizer (fp32 master weights
and Adam moments sharded), overlapped grad reduce-scatter and param all-gather, and a frozen reference; PP=2
with two virtual stages; Qwen3-MoE at EP=2 (expert buffers, chained optimizer)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mp import run_ranks

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.multiproc
LAYOUTS = ("dp2", "vpp", "ep")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from mcpo_megatron.models.tiny import make_tiny_hf_model

    out = tmp_path_factory.mktemp("offload")
    qwen3 = make_tiny_hf_model("qwen3", out / "qwen3", seed=3)
    moe = make_tiny_hf_model("qwen3_moe", out / "moe", seed=5)
    run_ranks(HERE / "workers" / "worker_offload.py", 2, [out, qwen3, moe], timeout=600)
    return {name: torch.load(out / f"{name}.pt", weights_only=False) for name in LAYOUTS}


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_steps_with_offload_equal_steps_without_bit_for_bit(results, layout):
    r = results[layout]
    off, res = r["offloaded"], r["resident"]
    assert off["metrics"] == res["metrics"]  # loss, grad norm, every metric sum: the same floats
    assert all(m["skipped"] == 0.0 and m["grad_norm"] > 0 for m in off["metrics"])
    assert off["params"].keys() == res["params"].keys()
    assert any(not torch.equal(off["params"][k], r["initial"][k]) for k in off["params"])  # the steps moved them
    assert all(_bitwise_equal(off["params"][k], res["params"][k]) for k in off["params"])
    assert len(off["optimizer"]) == len(res["optimizer"]) > 0
    assert all(_bitwise_equal(a, b) for a, b in zip(off["optimizer"], res["optimizer"]))
    assert len(off["ref_logp"]) == len(res["ref_logp"])
    for a, b in zip(off["ref_logp"], res["ref_logp"]):
        assert all(_bitwise_equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_offloaded_storages_are_released_and_restored(results, layout):
    r = results[layout]
    assert r["chunks"] == (2 if layout == "vpp" else 1)
    for released in r["released"]:
        for part in ("params", "grads", "moments"):
            assert released[part] and set(released[part]) == {0}, (part, released[part])
        if layout == "dp2":  # bf16 weights: separate fp32 master weights, and the reference
            assert released["master_weights"] and set(released["master_weights"]) == {0}
            assert released["reference"] and set(released["reference"]) == {0}
        else:  # fp32: the optimizer updates the parameters' own buffer, no separate copy
            assert released["master_weights"] == []
    assert all(size > 0 for size in r["params_kept"])  # offload(keep_params=True): a weight update can read them
    assert all(size > 0 for size in r["restored"])
    assert all(r["param_in_buffer"])  # every parameter is a view of its DDP buffer after onload
