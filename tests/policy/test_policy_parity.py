"""MegatronPolicy on 4 CPU processes (TP2xPP2, TP2 x DP2, PP2 x DP2, and PP2 x DP2 with megatron DDP's overlapped
gradient reduction and parameter all-gather) against transformers in float64.

One torchrun launch (``worker_policy.py``) runs every layout; this module builds the
single-process reference: the same tiny Qwen3 model in transformers (float64), the same
MCPO loss (``algorithms.losses.policy_loss`` with hinge-KL, dual clip and an entropy
bonus) on the whole batch at once, plain autograd, and a hand-written AdamW step.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from common import TEMPERATURE, add_weights, make_batch, mcpo_loss, padded
from mp import run_ranks
from reshard_compare import check_plan_vs_stream

HERE = Path(__file__).resolve().parent
LAYOUTS = ("tp2pp2", "tp2", "pp2", "tied_tp2pp2", "pp2_overlap")
# Must match worker_policy.OPTIM.
LR, WD, BETA1, BETA2, EPS, CLIP = 1e-3, 0.1, 0.9, 0.95, 1e-8, 0.5


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from mcpo_megatron.models.tiny import make_tiny_hf_model

    out = tmp_path_factory.mktemp("policy")
    dirs = {"qwen3": make_tiny_hf_model("qwen3", out / "qwen3", seed=3),
            "tied": make_tiny_hf_model("llama-tied", out / "tied", seed=4)}
    run_ranks(HERE / "workers" / "worker_policy.py", 4, [out, dirs["qwen3"], dirs["tied"]], timeout=480)
    results = {name: torch.load(out / f"{name}.pt", weights_only=False) for name in LAYOUTS}
    return dirs, results


@pytest.fixture(scope="module")
def hf_models(run):
    from transformers import AutoModelForCausalLM

    models = {}
    for key, path in run[0].items():
        models[key] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, attn_implementation="eager")
        models[key].eval()
    return models


def model_for(hf_models, layout):
    return hf_models["tied" if layout.startswith("tied") else "qwen3"]


def ref_logprobs(model, batch):
    """Per-sequence float64 log-probs and entropy of the response tokens at TEMPERATURE (with autograd)."""
    logps, ents = [], []
    for i, ids in enumerate(batch.input_ids):
        p, r = int(batch.prompt_lens[i]), int(batch.response_lens[i])
        logits = model(ids[None]).logits[0].double() / TEMPERATURE
        lsm = torch.log_softmax(logits[p - 1 : p + r - 1], dim=-1)
        logps.append(lsm.gather(-1, ids[p : p + r, None]).squeeze(-1))
        ents.append(-(lsm.exp() * lsm).sum(-1))
    return logps, ents


def ref_loss_and_grads(model, old_logp, batch=None):
    """The MCPO loss and its gradients in ``model`` (float64) on ``batch`` (the probe batch when None)."""
    batch = make_batch(model.config.vocab_size) if batch is None else batch
    batch.token_fields["old_logp"] = old_logp
    add_weights(batch)
    model.zero_grad()
    logps, ents = ref_logprobs(model, batch)
    width = int(batch.response_lens.max())
    mask = torch.arange(width)[None, :] < batch.response_lens[:, None]
    f = {k: padded(v, width) for k, v in batch.token_fields.items()}
    loss, _ = mcpo_loss(padded(logps, width), f["old_logp"], batch.seq_fields["advantage"].double(),
                        f["pg_weight"], f["hkl_weight"], mask, padded(ents, width))
    loss.backward()
    loss = loss.detach()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return float(loss), grads


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_logprobs_and_entropy_match_transformers(run, hf_models, layout):
    res = run[1][layout]
    hf_model = model_for(hf_models, layout)
    batch = make_batch(hf_model.config.vocab_size)
    with torch.no_grad():
        ref_lp, ref_ent = ref_logprobs(hf_model, batch)
    assert len(res["logp"]) == len(batch)
    for i in range(len(batch)):
        assert res["logp"][i].shape == ref_lp[i].shape
        assert torch.allclose(res["logp"][i].double(), ref_lp[i], atol=1e-5, rtol=0), (layout, i)
        assert torch.allclose(res["entropy"][i].double(), ref_ent[i], atol=1e-5, rtol=0), (layout, i)
    # compute_entropy=False gives the same log-probs and no entropy.
    assert res["logp_only_max_diff"] == 0.0 and res["no_entropy_is_none"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mcpo_gradients_match_reference_for_1_and_many_microbatches(run, hf_models, layout):
    res = run[1][layout]
    hf_model = model_for(hf_models, layout)
    ref_loss, ref_grads = ref_loss_and_grads(hf_model, res["old_logp"])
    # The perturbation makes the hinge and the clip bite; the loss is not trivially 0.
    assert abs(ref_loss) > 1e-3
    for tag in ("one", "many"):
        m = res[f"metrics_{tag}"]
        # The loss is a signed sum (advantages of both signs): an absolute fp32 tolerance.
        assert abs(m["loss"] - ref_loss) < 2e-6, (layout, tag, m["loss"], ref_loss)
        grads = res[f"grads_{tag}"]
        assert set(grads) == set(ref_grads), (layout, set(grads) ^ set(ref_grads))
        for name, g in ref_grads.items():
            assert rel_err(grads[name], g) < 2e-5, (layout, tag, name, rel_err(grads[name], g))
    assert res["metrics_one"]["num_microbatches"] == res["dp"]
    assert res["metrics_many"]["num_microbatches"] >= 4


def test_overlapped_parameter_gather_waits_for_sync(run):
    """With overlap_param_gather a step leaves other ranks' shards stale until sync_params (which readers outside a
    forward call); the parity tests above then hold for that layout too."""
    assert run[1]["pp2_overlap"]["sync_changed"] > 1e-5


def test_hinge_and_clip_are_active(run):
    """The probe really exercises the hinge-KL and the PPO clip (metric sums from policy_loss)."""
    m = run[1]["tp2pp2"]["metrics_one"]
    assert m["hinge_active"] > 5 and m["pg_clipped_high"] + m["pg_clipped_low"] > 0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_one_optimizer_step_matches_reference_adamw(run, hf_models, layout):
    res = run[1][layout]
    hf_model = model_for(hf_models, layout)
    _, grads = ref_loss_and_grads(hf_model, res["old_logp"])
    norm = math.sqrt(sum(float(g.pow(2).sum()) for g in grads.values()))
    m = res["step_metrics"]
    assert math.isclose(m["grad_norm"], norm, rel_tol=1e-5), (m["grad_norm"], norm)
    assert m["lr"] == LR and m["skipped"] == 0.0
    coef = min(1.0, CLIP / (norm + 1e-6))
    for name, p in hf_model.named_parameters():
        g = grads[name] * coef
        # First AdamW step: m_hat = g, v_hat = g^2; no decay on 1-D parameters (megatron's rule).
        update = g / (g.abs() + EPS)
        decay = WD if p.dim() > 1 else 0.0
        expected = p.detach() * (1 - LR * decay) - LR * update
        got = res["params_after"][name].double()
        # |g| near Adam's eps: g / (|g| + eps) is steep there, so fp32 rounding of tiny
        # gradients can move those entries by up to 2 * lr; require 1e-6 everywhere else.
        diff = (got - expected).abs()
        steep = g.abs() < 1e-5
        flat_max = lambda t: float(t.max()) if t.numel() else 0.0  # noqa: E731
        assert flat_max(diff[~steep]) < 1e-6, (layout, name, flat_max(diff[~steep]))
        assert flat_max(diff[steep]) <= 2 * LR + 1e-6, (layout, name)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_checkpoint_round_trip_restores_params_and_optimizer(run, layout):
    res = run[1][layout]
    assert res["fresh_differs"] > 1e-3  # the restored policy started from other weights
    assert res["weights_only_max_diff"] == 0.0
    assert res["loaded_max_diff"] == 0.0
    assert res["loaded_lr"] == res["orig_lr"]
    m2, m3 = res["next_step_metrics"]
    assert m2["loss"] == m3["loss"] and m2["grad_norm"] == m3["grad_norm"]
    assert res["next_step_moved"] > 1e-5  # the step changed the weights...
    assert res["next_step_max_diff"] == 0.0  # ...identically (Adam moments restored)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_non_finite_gradient_skips_the_update(run, layout):
    res = run[1][layout]
    m = res["nan_step_metrics"]
    assert m["skipped"] == 1.0 and math.isnan(m["grad_norm"])
    assert res["nan_step_max_diff"] == 0.0 and res["nan_step_lr_kept"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_weight_update_plan_equals_the_hf_stream_bit_for_bit(run, layout):
    """After an optimizer step, the compiled reshard plan writes exactly the HF stream's weights into the PyTorch
    engine (tied heads, TP x PP, DP, overlapped parameter gather)."""
    check_plan_vs_stream(run[1][layout]["plan_vs_stream"])
