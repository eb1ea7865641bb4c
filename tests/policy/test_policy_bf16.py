"""bf16 MegatronPolicy (TP=2, CPU) against transformers float64: bf16-level agreement.

The fp32 parity tests pin the numerics; this one checks that the bf16 path (bf16
weights and activations, fp32 master weights and Adam state in the distributed
optimizer, fp32 log-prob kernel) runs and moves the weights the way the reference
gradient says.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from common import TEMPERATURE
from mp import run_torchrun
from test_policy_parity import ref_loss_and_grads, ref_logprobs

HERE = Path(__file__).resolve().parent


def run_bf16_worker(out: Path, env=None):
    """Run worker_bf16.py on 2 ranks (on the GPUs when there are any: init_distributed picks CUDA); return its
    results and the float64 transformers reference."""
    from transformers import AutoModelForCausalLM

    from mcpo_megatron.models.sources import make_tiny_hf_model

    model_dir = make_tiny_hf_model("qwen3", out / "qwen3", seed=3)
    run_torchrun(HERE / "worker_bf16.py", 2, [out, model_dir], timeout=300, env=env)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64, attn_implementation="eager")
    return torch.load(out / "bf16.pt", weights_only=False), hf.eval()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return run_bf16_worker(tmp_path_factory.mktemp("bf16"))


def test_bf16_logprobs_close_to_float64(run):
    check_bf16_logprobs(*run)


def test_bf16_step_follows_reference_gradient(run):
    check_bf16_step(*run)


def check_bf16_logprobs(res, hf):
    from common import make_batch

    assert res["param_dtype"] == "torch.bfloat16"
    with torch.no_grad():
        ref_lp, ref_ent = ref_logprobs(hf, make_batch(hf.config.vocab_size))
    err = max(float((a.double() - b).abs().max()) for a, b in zip(res["logp"], ref_lp) if b.numel())
    scale = max(float(b.abs().max()) for b in ref_lp if b.numel())
    assert err < 0.05 * scale, (err, scale)
    assert TEMPERATURE != 1.0


def check_bf16_step(res, hf):
    _, grads = ref_loss_and_grads(hf, res["old_logp"])
    norm = math.sqrt(sum(float(g.pow(2).sum()) for g in grads.values()))
    m = res["metrics"]
    assert m["skipped"] == 0.0 and math.isclose(m["grad_norm"], norm, rel_tol=0.05), (m["grad_norm"], norm)
    # First Adam step: delta = -lr * g / (|g| + eps), i.e. -lr * sign(g) where the gradient is clear.
    agree = total = 0
    for name, g in grads.items():
        delta = (res["after"][name].double() - res["before"][name].double())
        clear = g.abs() > 1e-3 * g.abs().max()
        agree += int(((delta[clear] * -g[clear]) > 0).sum())
        total += int(clear.sum())
    assert total > 1000 and agree / total > 0.97, (agree, total)
