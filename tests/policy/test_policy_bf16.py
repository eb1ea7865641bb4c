"""bf16 MegatronPolicy (TP=2, CPU) against transformers float64: bf16-level agreement.

The fp32 parity tests pin the numerics; this one checks that the bf16 path (bf16
weights and activations, fp32 master weights and Adam state in the distributed
optimizer, fp32 log-prob kernel) runs and moves the weights the way the reference
gradient says. The figures and their limits are shared with the GPU checks (tests/gpu,
the GPU kit's parity check on one GPU).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from common import TEMPERATURE
from mp import run_ranks
from reshard_compare import check_plan_vs_stream
from test_policy_parity import ref_loss_and_grads, ref_logprobs

HERE = Path(__file__).resolve().parent

LOGP_TOL = 0.05           # max |log-prob diff| as a fraction of the largest |reference log-prob|
GRAD_NORM_RTOL = 0.05     # gradient norm vs float64
SIGN_AGREEMENT = 0.97     # first Adam step: share of clear gradient entries moved against the gradient's sign
MIN_CLEAR = 1000          # entries with a clear gradient sign needed for that share to mean something


def run_bf16_worker(out: Path, env=None, nproc: int = 2):
    """Run worker_bf16.py on ``nproc`` ranks, TP = nproc (on the GPUs when there are any: init_distributed
    picks CUDA); return its results and the float64 transformers reference."""
    from transformers import AutoModelForCausalLM

    from mcpo_megatron.models.tiny import make_tiny_hf_model

    model_dir = make_tiny_hf_model("qwen3", out / "qwen3", seed=3)
    run_ranks(HERE / "workers" / "worker_bf16.py", nproc, [out, model_dir], timeout=300, env=env)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64, attn_implementation="eager")
    return torch.load(out / "bf16.pt", weights_only=False), hf.eval()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return run_bf16_worker(tmp_path_factory.mktemp("bf16"))


def test_bf16_logprobs_close_to_float64(run):
    check_bf16_logprobs(*run)


def test_bf16_step_follows_reference_gradient(run):
    check_bf16_step(*run)


def logprob_figures(res, hf) -> dict:
    """The policy's bf16 log-probs of the probe batch against transformers float64."""
    from common import make_batch

    with torch.no_grad():
        ref_lp, _ = ref_logprobs(hf, make_batch(hf.config.vocab_size))
    err = max(float((a.double() - b).abs().max()) for a, b in zip(res["logp"], ref_lp) if b.numel())
    scale = max(float(b.abs().max()) for b in ref_lp if b.numel())
    return {"param_dtype": res["param_dtype"], "max_abs_logp_diff": err, "logp_scale": scale,
            "relative_logp_diff": err / scale}


def step_figures(res, hf) -> dict:
    """One training step against the float64 reference gradient: its norm and the first Adam step's signs."""
    _, grads = ref_loss_and_grads(hf, res["old_logp"])
    norm = math.sqrt(sum(float(g.pow(2).sum()) for g in grads.values()))
    m = res["metrics"]
    # First Adam step: delta = -lr * g / (|g| + eps), i.e. -lr * sign(g) where the gradient is clear.
    agree = total = 0
    for name, g in grads.items():
        delta = (res["after"][name].double() - res["before"][name].double())
        clear = g.abs() > 1e-3 * g.abs().max()
        agree += int(((delta[clear] * -g[clear]) > 0).sum())
        total += int(clear.sum())
    return {"skipped": m["skipped"], "grad_norm": m["grad_norm"], "ref_grad_norm": norm,
            "grad_norm_rel_diff": abs(m["grad_norm"] - norm) / norm, "clear_entries": total,
            "sign_agreement": agree / max(total, 1)}


def failures(figures: dict) -> list[str]:
    """The limits ``figures`` (from logprob_figures and/or step_figures) break, one message each."""
    out = []
    if "param_dtype" in figures and figures["param_dtype"] != "torch.bfloat16":
        out.append(f"parameters are {figures['param_dtype']}, not torch.bfloat16")
    if figures.get("relative_logp_diff", 0.0) >= LOGP_TOL:
        out.append(f"max |log-prob diff| {figures['max_abs_logp_diff']:.3g} >= {LOGP_TOL:g} x "
                   f"{figures['logp_scale']:.3g}")
    if "grad_norm" in figures:
        if figures["skipped"] != 0.0:
            out.append("the step was skipped (non-finite gradient)")
        if not figures["grad_norm_rel_diff"] < GRAD_NORM_RTOL:
            out.append(f"grad norm {figures['grad_norm']:.4g} vs float64 {figures['ref_grad_norm']:.4g}: "
                       f"relative diff {figures['grad_norm_rel_diff']:.3g} >= {GRAD_NORM_RTOL:g}")
        if figures["clear_entries"] <= MIN_CLEAR or figures["sign_agreement"] <= SIGN_AGREEMENT:
            out.append(f"first Adam step against the reference gradient's sign on {figures['sign_agreement']:.3f} "
                       f"of {figures['clear_entries']} clear entries (needs > {SIGN_AGREEMENT:g} of > {MIN_CLEAR})")
    return out


def check_bf16_logprobs(res, hf):
    figures = logprob_figures(res, hf)
    assert not failures(figures), figures
    assert TEMPERATURE != 1.0


def check_bf16_step(res, hf):
    figures = step_figures(res, hf)
    assert not failures(figures), figures


def test_weight_update_plan_equals_the_hf_stream_bit_for_bit(run):
    check_plan_vs_stream(run[0]["plan_vs_stream"])
