"""Qwen3-MoE policy on 4 CPU processes (EP=2, TP=2 x EP=2 with sequence parallelism, PP=2 x EP=2) against
transformers (and, at EP=2, with the load-balancing loss and with activation recomputation).

One torchrun launch (``worker_moe.py``) runs every layout; this module builds the references: the tiny
Qwen3-MoE in transformers (fp32 for logits, float64 with eager experts for log-probs, the MCPO loss, its
gradient and the load-balancing loss), checkpoint round trips, the HF export of the trained policy re-loaded
by transformers, and the CPU rollout engine fed by the resharder.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from common import TEMPERATURE, add_weights, make_batch, mcpo_loss, padded
from mp import run_ranks
from reshard_compare import check_plan_vs_stream

pytestmark = pytest.mark.multiproc

HERE = Path(__file__).resolve().parent
LAYOUTS = ("ep2", "tp2ep2", "pp2ep2")
AUX_COEFF = 0.05  # worker_moe.AUX_COEFF


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from mcpo_megatron.models.tiny import make_tiny_hf_model

    out = tmp_path_factory.mktemp("moe")
    model_dir = make_tiny_hf_model("qwen3_moe", out / "model", seed=5)
    run_ranks(HERE / "workers" / "worker_moe.py", 4, [out, model_dir], timeout=900)
    return out, model_dir, {name: torch.load(out / f"{name}.pt", weights_only=False) for name in LAYOUTS}


@pytest.fixture(scope="module")
def hf64(run):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(run[1], dtype=torch.float64, attn_implementation="eager",
                                                 experts_implementation="eager")
    return model.eval()


@pytest.fixture(scope="module")
def probe64(hf64):
    """Log-probs, entropy and router logits of the probe batch in float64 (no gradient)."""
    with torch.no_grad():
        return forward_sequences(hf64, make_batch(hf64.config.vocab_size))


@pytest.fixture(scope="module")
def refs(run, hf64):
    """Per layout: the float64 MCPO loss and gradient for that layout's old log-probs (computed once)."""
    return {layout: reference(hf64, run[2][layout]["old_logp"])[:2] for layout in LAYOUTS}


def checkpoint_named(model, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' fused expert tensors -> the checkpoint's per-expert names (gate rows first, then up)."""
    out = {}
    for name, t in tensors.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix, inter = name[: -len(".gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.gate_proj.weight"] = t[e, :inter]
                out[f"{prefix}.{e}.up_proj.weight"] = t[e, inter:]
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name[: -len(".down_proj")]
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return out


def forward_sequences(model, batch):
    """Per sequence: response log-probs and entropy (TEMPERATURE), and each layer's router logits."""
    logps, ents, routers = [], [], []
    for i, ids in enumerate(batch.input_ids):
        p, r = int(batch.prompt_lens[i]), int(batch.response_lens[i])
        out = model(ids[None], output_router_logits=True)
        lsm = torch.log_softmax(out.logits[0].double()[p - 1 : p + r - 1] / TEMPERATURE, dim=-1)
        logps.append(lsm.gather(-1, ids[p : p + r, None]).squeeze(-1))
        ents.append(-(lsm.exp() * lsm).sum(-1))
        routers.append([z.double() for z in out.router_logits])  # per layer [tokens, E]
    return logps, ents, routers


def switch_loss(router_logits: torch.Tensor, topk: int) -> torch.Tensor:
    """E * sum_e f_e P_e over the given tokens (f_e: share of the top-k slots; P_e: mean probability)."""
    probs = torch.softmax(router_logits, dim=-1)
    n, e = probs.shape
    chosen = torch.zeros_like(probs).scatter(1, probs.topk(topk, dim=-1).indices, 1.0)
    return e * ((chosen.sum(0) / (topk * n)) * (probs.sum(0) / n)).sum()


def reference(model, old_logp, aux_shards=None):
    """MCPO loss (+ AUX_COEFF x the token-weighted per-micro-batch load-balancing loss when ``aux_shards``
    lists each DP rank's sequences, one micro-batch per rank) and its float64 gradient, checkpoint-named."""
    batch = make_batch(model.config.vocab_size)
    batch.token_fields["old_logp"] = old_logp
    add_weights(batch)
    model.zero_grad()
    logps, ents, routers = forward_sequences(model, batch)
    width = int(batch.response_lens.max())
    mask = torch.arange(width)[None, :] < batch.response_lens[:, None]
    f = {k: padded(v, width) for k, v in batch.token_fields.items()}
    loss, _ = mcpo_loss(padded(logps, width), f["old_logp"], batch.seq_fields["advantage"].double(),
                        f["pg_weight"], f["hkl_weight"], mask, padded(ents, width))
    if aux_shards is not None:
        k = model.config.num_experts_per_tok
        total = sum(int(x.numel()) for x in batch.input_ids)
        for shard_idx in aux_shards:
            n_mb = sum(int(batch.input_ids[i].numel()) for i in shard_idx)
            for layer in range(model.config.num_hidden_layers):
                z = torch.cat([routers[i][layer] for i in shard_idx])
                loss = loss + AUX_COEFF * n_mb / total * switch_loss(z, k)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return float(loss.detach()), checkpoint_named(model, grads), routers


def rel_err(a, b) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30))


def test_routing_is_well_posed(hf64, probe64):
    """No token's k-th and (k+1)-th router probabilities are within 1e-4: fp32 and fp64 pick the same experts."""
    routers = probe64[2]
    k = hf64.config.num_experts_per_tok
    gaps = [torch.softmax(z, -1).topk(k + 1, -1).values.diff(dim=-1)[:, -1].abs().min() for r in routers for z in r]
    assert min(float(g) for g in gaps) > 1e-4


@pytest.mark.parametrize("layout", LAYOUTS)
def test_logits_match_transformers(run, layout):
    from transformers import AutoModelForCausalLM

    from mcpo_megatron.models.parity import probe_ids

    hf = AutoModelForCausalLM.from_pretrained(run[1], dtype=torch.float32).eval()
    ids = probe_ids(256, 2, 12, seed=0)
    with torch.no_grad():
        ref = hf(ids).logits
    got = run[2][layout]["logits"]
    assert got.shape == ref.shape
    assert (got - ref).abs().max().item() <= 1e-4, (layout, (got - ref).abs().max().item())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_logprobs_and_gradients_match_float64_reference(run, probe64, refs, layout):
    res = run[2][layout]
    assert res["ep"] == 2
    ref_lp, ref_ent, _ = probe64
    for i in range(len(ref_lp)):
        assert torch.allclose(res["logp"][i].double(), ref_lp[i], atol=1e-5, rtol=0), (layout, i)
        assert torch.allclose(res["entropy"][i].double(), ref_ent[i], atol=1e-5, rtol=0), (layout, i)
    ref_loss, ref_grads = refs[layout]
    m = res["metrics"]
    assert abs(m["loss"] - ref_loss) < 2e-6, (layout, m["loss"], ref_loss)
    assert m["num_microbatches"] >= 8  # one sequence per micro-batch
    assert set(res["grads"]) == set(ref_grads)
    worst = max(rel_err(res["grads"][k], g) for k, g in ref_grads.items())
    assert worst < 2e-5, (layout, worst)
    # every expert of every layer received gradient (the routing spreads the probe over all experts)
    assert all(float(g.abs().max()) > 0 for k, g in res["grads"].items() if ".experts." in k)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_expert_load_metrics_match_reference(run, hf64, probe64, layout):
    m = run[2][layout]["metrics"]
    routers = probe64[2]
    k, e = hf64.config.num_experts_per_tok, hf64.config.num_experts
    per_layer = [torch.cat([r[layer] for r in routers]) for layer in range(hf64.config.num_hidden_layers)]
    expected = sum(float(switch_loss(z, k)) for z in per_layer) / len(per_layer)
    assert m["moe/aux_loss"] == pytest.approx(expected, rel=1e-5)
    loads = [e * torch.zeros(e, dtype=torch.float64).scatter_add(
        0, torch.softmax(z, -1).topk(k, -1).indices.reshape(-1), torch.ones(z.shape[0] * k, dtype=torch.float64))
        / (k * z.shape[0]) for z in per_layer]
    assert m["moe/max_expert_load"] == pytest.approx(max(float(x.max()) for x in loads), rel=1e-9)
    assert m["moe/min_expert_load"] == pytest.approx(min(float(x.min()) for x in loads), rel=1e-9)


def test_load_balancing_loss_gradient(run, hf64, refs):
    res = run[2]["ep2"]
    ref_loss, ref_grads, _ = reference(hf64, res["old_logp"], aux_shards=res["aux_shards"])
    plain_loss, plain_grads = refs["ep2"]
    # the term changes the router gradients visibly
    router = [k for k in ref_grads if k.endswith("mlp.gate.weight")]
    assert min(rel_err(plain_grads[k], ref_grads[k]) for k in router) > 1e-3
    # the policy loss metric excludes the auxiliary term; the gradient includes it
    assert abs(res["aux_metrics"]["loss"] - plain_loss) < 2e-6
    worst = max(rel_err(res["aux_grads"][k], g) for k, g in ref_grads.items())
    assert worst < 2e-5, worst


def test_recomputation_gives_the_same_gradient_and_expert_load(run):
    res = run[2]["ep2"]
    assert res["recompute_metrics"]["loss"] == res["metrics"]["loss"]
    for key in ("moe/aux_loss", "moe/max_expert_load", "moe/min_expert_load"):
        assert res["recompute_metrics"][key] == pytest.approx(res["metrics"][key], rel=1e-12), key
    worst = max(rel_err(res["recompute_grads"][k], g) for k, g in res["grads"].items())
    assert worst < 1e-6, worst


@pytest.mark.parametrize("layout", LAYOUTS)
def test_optimizer_step_and_checkpoint_round_trip(run, refs, layout):
    res = run[2][layout]
    grads = refs[layout][1]
    norm = math.sqrt(sum(float(g.pow(2).sum()) for g in grads.values()))
    assert math.isclose(res["step_metrics"]["grad_norm"], norm, rel_tol=1e-5)
    assert res["fresh_differs"] > 1e-3
    assert res["loaded_max_diff"] == 0.0
    m2, m3 = res["next_step_metrics"]
    assert m2["loss"] == m3["loss"] and m2["grad_norm"] == m3["grad_norm"]
    assert res["next_step_moved"] > 1e-5 and res["next_step_max_diff"] == 0.0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_export_of_trained_policy_matches_in_transformers(run, layout):
    from transformers import AutoModelForCausalLM

    out, _, results = run
    res = results[layout]
    hf = AutoModelForCausalLM.from_pretrained(out / f"export_{layout}", dtype=torch.float32,
                                              experts_implementation="eager").eval()
    batch = make_batch(hf.config.vocab_size)
    with torch.no_grad():
        ref_lp, _, _ = forward_sequences(hf, batch)
    worst = max(float((a.double() - b).abs().max()) if b.numel() else 0.0 for a, b in zip(res["trained_logp"], ref_lp))
    assert worst <= 1e-4, (layout, worst)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_engine_receives_expert_weights_and_agrees_with_trainer(run, layout):
    res = run[2][layout]
    assert res["engine_names_missing"] == [] and res["engine_vs_export_mismatch"] == []
    c = res["contract"]
    assert c["tokens"] > 0 and c["max_abs_diff"] < 1e-4 and c["k3_kl"] < 1e-8, c


@pytest.mark.parametrize("layout", LAYOUTS)
def test_weight_update_plan_equals_the_hf_stream_bit_for_bit(run, layout):
    """Experts batched in the plan's rounds: far fewer collectives than the stream's per-bucket gathers and
    broadcasts."""
    r = run[2][layout]["plan_vs_stream"]
    check_plan_vs_stream(r)
    assert 0 < r["collectives"] < r["stream_collectives"], r
