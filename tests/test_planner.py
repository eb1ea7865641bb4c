"""`mcpo plan`: memory estimates on hand-computed cases, against a real megatron-core model's tensors, the
refusal messages, and the cluster recipes."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from mcpo_megatron import config as C
from mcpo_megatron import planner as P

REPO = Path(__file__).resolve().parents[1]
GIB = 1024 ** 3


def _shape(**kw):
    base = dict(num_layers=2, hidden_size=8, num_attention_heads=4, num_key_value_heads=2, ffn_hidden_size=12,
                vocab_size=16, head_dim=2, tie_word_embeddings=False, family="llama")
    base.update(kw)
    return SimpleNamespace(**base)


def _cfg(**over):
    d = {
        "model": {"dtype": "bf16", "recompute_activations": False},
        "parallelism": {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1,
                        "use_distributed_optimizer": True, "sequence_parallel": False},
        "rollout": {"tensor_parallel_size": 2, "gpu_memory_utilization": 0.5, "max_new_tokens": 96,
                    "max_num_seqs": 4},
        "data": {"max_prompt_length": 32},
        "trainer": {"max_tokens_per_microbatch": 128, "logprob_chunk_size": 64},
    }
    cfg = OmegaConf.create(d)
    for k, v in over.items():
        OmegaConf.update(cfg, k, v)
    return cfg


# ------------------------------------------------------------------ hand-computed cases

def test_param_counts_hand_computed():
    s = _shape()
    # one layer, unsplit: q = 4 heads x 2 = 8, kv = 2 groups x 2 = 4
    #   QKV 8 x (8 + 4 + 4) = 128, output projection 8 x 8 = 64, fc1 8 x 24 = 192, fc2 12 x 8 = 96 -> 480
    #   + two RMSNorm weights 2 x 8 = 16  -> 496
    assert P.layer_params_per_rank(s, 1) == 496
    assert P.layer_params_per_rank(s, 2) == 480 // 2 + 16
    c = P.param_counts(s, tp=2, pp=1)
    # total: 2 layers x 496 + embedding 16 x 8 + output 16 x 8 + final norm 8
    assert c["total"] == 2 * 496 + 128 + 128 + 8
    # PP=1: one stage holds everything; matrices halved by TP, norms replicated
    assert c["stage_max"] == 2 * 256 + 64 + 64 + 8
    c2 = P.param_counts(s, tp=1, pp=2)
    assert c2["first"] == 496 + 128 and c2["last"] == 496 + 128 + 8


def test_param_counts_gqa_padding_qwen3_norms_and_tied():
    # kv = 2 heads at TP = 4: megatron pads to 4 query groups (2 heads each -> 8 query heads)
    s = _shape(family="qwen3")
    # q = 8 heads x 2 = 16, kv = 4 x 2 = 8: QKV 8 x 32 = 256, proj 16 x 8 = 128, MLP 288 -> 672 / 4 = 168
    # + norms 16 + q/k norms 2 x 2 = 4
    assert P.layer_params_per_rank(s, 4) == 168 + 16 + 4
    tied = _shape(tie_word_embeddings=True)
    assert P.param_counts(tied, 1, 1)["stage_max"] == 2 * 496 + 128 + 8     # one shared embedding
    assert P.param_counts(tied, 1, 2)["last"] == 496 + 128 + 8              # last stage keeps its copy


def test_moe_param_counts_and_optimizer_hand_computed():
    # 2 layers, h=8, q = 4 heads x 2, kv = 2 x 2: attention 8 x 16 + 8 x 8 = 192; 4 experts of width 6
    s = _shape(family="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_ffn_hidden_size=6)
    # per layer on one rank at TP=2, EP=2: attention 192/2 + norms 16 + q/k norms 4 + router 4 x 8 = 148;
    # experts: 2 local x 3 x 8 x 6 / 2 = 144
    assert P.layer_params_split(s, 2, 2) == (148, 144)
    c = P.param_counts(s, tp=2, pp=1, ep=2)
    assert c["expert_stage"] == 2 * 144
    full_dense, full_expert = 192 + 16 + 4 + 32, 4 * 3 * 8 * 6
    assert c["total"] == 2 * (full_dense + full_expert) + 2 * 16 * 8 + 8
    assert c["total_active"] == 2 * (full_dense + full_expert // 2) + 2 * 16 * 8 + 8
    cfg = _cfg(**{"parallelism.expert_model_parallel_size": 2})
    t = P.estimate_training_memory(s, cfg, world=8)     # TP=2: DP=4, expert-DP = 8 / (2 x 2) = 2
    dense = c["stage_max"] - c["expert_stage"]
    assert t["optimizer"].bytes == pytest.approx(12 * dense / 4 + 12 * c["expert_stage"] / 2)
    assert "EP=2" in t["weights"].note and "expert-DP=2" in t["optimizer"].note
    # activations: replicated 2 x 4h; attention 2 x (q + 2kv + q/k norms (q + kv) + q) / t; the MLP term is
    # k routed copies (2h in/out + 3I/t) plus fp32 router scores 4E; softmax statistics 4 heads / t
    per = P.activation_bytes_per_token_layer(s, 2, False)
    assert per == 2 * 4 * 8 + 2 * (8 + 2 * 4 + (8 + 4) + 8) / 2 + 2 * 2 * (2 * 8 + 3 * 6 / 2) + 4 * 4 + 4 * 4 / 2


def test_virtual_pipeline_in_flight():
    s = _shape(num_layers=8)
    base = {"parallelism.tensor_model_parallel_size": 1, "parallelism.pipeline_model_parallel_size": 4,
            "trainer.max_tokens_per_microbatch": 4096}
    per = P.activation_bytes_per_token_layer(s, 1, False)
    plain = P.estimate_training_memory(s, _cfg(**base), world=4)
    inter = P.estimate_training_memory(s, _cfg(**base, **{"parallelism.virtual_pipeline_model_parallel_size": 2}),
                                       world=4)
    assert plain["activations"].bytes == 4096 * 4 * 2 * per
    # ceil(4 * (1 + 3 / 8)) = 6 micro-batches in flight with interleaving
    assert inter["activations"].bytes == 4096 * 6 * 2 * per


def test_training_terms_hand_computed():
    s = _shape()
    cfg = _cfg()
    t = P.estimate_training_memory(s, cfg, world=8)     # TP=2 -> DP=4
    p = 2 * 256 + 64 + 64 + 8
    assert t["weights"].bytes == 2 * p
    assert t["grads"].bytes == 4 * p
    assert t["optimizer"].bytes == pytest.approx(12 * p / 4)
    # activations per token per layer (bf16, TP=2, no SP): replicated 2 x 4h = 64;
    # split 2 x (q 8 + 2kv 8 + out 8 + 3F 36) / 2 = 60; softmax stats 4 x 4 heads / 2 = 8
    per = 64 + 60 + 8
    assert P.activation_bytes_per_token_layer(s, 2, False) == per
    assert t["activations"].bytes == 128 * 1 * 2 * per
    assert t["logits"].bytes == 128 * 8 * 2 * 2
    assert t["logprob_chunk"].bytes == 64 * 8 * 4 * 3
    # sequence parallelism splits the replicated part too
    assert P.activation_bytes_per_token_layer(s, 2, True) == 64 / 2 + 60 + 8
    # no distributed optimizer: the optimizer is not sharded
    t_nd = P.estimate_training_memory(s, _cfg(**{"parallelism.use_distributed_optimizer": False}), world=8)
    assert t_nd["optimizer"].bytes == 12 * p


def test_reference_kl_adds_one_copy_of_the_stage_weights_in_both_phases():
    s = _shape()
    p = 2 * 256 + 64 + 64 + 8                             # busiest stage, TP=2
    t = P.estimate_training_memory(s, _cfg(**{"algorithm.kl.enable": True}), world=8)
    assert t["reference"].bytes == 2 * p                  # bf16 weights only: no gradients, no optimizer
    assert "reference" not in P.estimate_training_memory(s, _cfg(), world=8)
    cfg = C.load_config(str(REPO / "configs/qwen3_8b_mcpo.yaml"), ["algorithm.name=grpo",
                                                                 "trainer.offload.enable=false"])
    off = P.plan(cfg, world=8, gpu_mem_gib=80)
    cfg.algorithm.kl.enable = True
    on = P.plan(cfg, world=8, gpu_mem_gib=80)
    ref = [x for x in on.training if x.name == "reference"][0]
    assert ref.bytes == [x for x in on.training if x.name == "weights"][0].bytes
    for phase in ("training", "rollout"):
        assert P.Plan.total(getattr(on, phase)) - P.Plan.total(getattr(off, phase)) == ref.bytes
    assert "| reference" in P.format_plan(on) and "| reference" not in P.format_plan(off)
    # trainer.offload (the recipes' default on GPUs) moves it out of the rollout phase with the rest
    cfg.trainer.offload.enable = None
    moved = P.plan(cfg, world=8, gpu_mem_gib=80)
    assert {t.name: t.bytes for t in moved.rollout}["reference"] == 0
    assert moved.offload["moved"]["reference"] == ref.bytes


def test_pipeline_in_flight_and_recompute():
    s = _shape(num_layers=4)
    cfg = _cfg(**{"parallelism.tensor_model_parallel_size": 1, "parallelism.pipeline_model_parallel_size": 2,
                  "trainer.max_tokens_per_microbatch": 4096})
    t = P.estimate_training_memory(s, cfg, world=2)
    per = P.activation_bytes_per_token_layer(s, 1, False)
    # the first stage under 1F1B holds PP = 2 micro-batches of its 2 layers; its activations exceed the last
    # stage's (1 micro-batch + logits), so the first stage is reported
    assert t["activations"].bytes == 4096 * 2 * 2 * per
    assert t["logits"].bytes == 0
    r = P.estimate_training_memory(s, _cfg(**{"parallelism.tensor_model_parallel_size": 1,
                                              "model.recompute_activations": True}), world=1)
    # full recompute: 4 layer inputs of 2h bytes per token + one layer recomputed
    assert r["activations"].bytes == 128 * (4 * 2 * 8 + per)


def test_engine_kv_cache_hand_computed():
    s = _shape()
    e = P.estimate_engine_memory(s, _cfg(), world=8, gpu_mem_bytes=10 * GIB)
    total = 2 * 496 + 256 + 8
    assert e["weights"] == total * 2 / 2
    assert e["budget"] == 5 * GIB
    assert e["kv_cache"] == 5 * GIB - total - P.ENGINE_ALLOWANCE_GIB * GIB
    # K and V x 2 layers x (2 kv heads / rollout TP 2 = 1) x head_dim 2 x 2 bytes
    assert e["kv_bytes_per_token"] == 2 * 2 * 1 * 2 * 2
    assert e["max_sequence_length"] == 32 + 96


# ------------------------------------------------------------------ hybrid decoders (Gated DeltaNet + attention)

# Tiny hybrid configs with sizes no other test uses: 3 layers with full attention every 3rd, 3 key heads of 5
# and 6 value heads of 7, conv width 5, 6 query heads of 12 in 3 groups; the MoE forms with a shared expert.
HYBRID = dict(vocab_size=40, hidden_size=24, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=3,
              head_dim=12, linear_num_key_heads=3, linear_num_value_heads=6, linear_key_head_dim=5,
              linear_value_head_dim=7, linear_conv_kernel_dim=5, tie_word_embeddings=False,
              layer_types=["linear_attention", "linear_attention", "full_attention"])
HYBRID_MOE = dict(num_experts=5, num_experts_per_tok=2, moe_intermediate_size=9, shared_expert_intermediate_size=11)


def _hf_hybrid(kind: str):
    import transformers as T

    if kind == "qwen3_5_text":
        return T.Qwen3_5ForCausalLM(T.Qwen3_5TextConfig(intermediate_size=20, **HYBRID))
    if kind == "qwen3_5_moe_text":
        return T.Qwen3_5MoeForCausalLM(T.Qwen3_5MoeTextConfig(**HYBRID, **HYBRID_MOE))
    return T.Qwen3NextForCausalLM(T.Qwen3NextConfig(intermediate_size=20, **HYBRID, **HYBRID_MOE))


@pytest.mark.parametrize("kind", ["qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"])
def test_hybrid_param_counts_are_transformers_tensors(kind, tmp_path):
    """The planner's total and active counts of Qwen3.5, Qwen3.5-MoE and Qwen3-Next (Gated DeltaNet layers, gated
    attention, the MoE forms' shared expert and its gate) are the parameters of transformers' model built from the
    config, read the way `mcpo plan` reads it (its config.json)."""
    model = _hf_hybrid(kind)
    model.config.save_pretrained(tmp_path)
    shape = C.model_shape(OmegaConf.create({"model": {"arch": None, "path": str(tmp_path)}}))
    assert shape.is_hybrid and shape.num_linear_attention_layers == 2 and shape.family == kind
    counts = P.param_counts(shape, 1, 1)
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    if kind != "qwen3_5_text":
        experts = [p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n]
        assert experts and counts["total_active"] == counts["total"] - sum(experts) * (1 - 2 / 5)


def test_hybrid_engine_holds_a_kv_cache_for_attention_layers_and_a_state_per_sequence():
    """Hand-computed: a Qwen3.5 shape of 4 layers (1 full attention) at rollout TP 2. KV per token: K and V x 1
    layer x (2 kv heads / 2) x head_dim 16 x 2 bytes. State per sequence and layer (vLLM's GDN state shapes):
    conv (4 - 1) x (2 x 2 x 8 + 4 x 6) / 2 bf16 values, delta rule 4 / 2 x 6 x 8 fp32 values (Qwen3.5's
    mamba_ssm_dtype), x 3 layers. A sequence of n tokens takes n x KV + the state."""
    shape = C.model_shape(OmegaConf.create({"model": {"path": "x", "arch": dict(
        num_layers=4, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, ffn_hidden_size=64,
        vocab_size=100, head_dim=16, family="qwen3_5_text", full_attention_interval=4, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=6, linear_conv_kernel_dim=4)}}))
    assert shape.layer_types == ("linear_attention",) * 3 + ("full_attention",) and shape.ssm_state_bytes == 4
    e = P.engine_memory(shape, rollout_tp=2, utilization=0.5, gpu_mem_bytes=10 * GIB, max_len=128)
    assert e["kv_bytes_per_token"] == 2 * 1 * 1 * 16 * 2
    state = 3 * ((4 - 1) * (2 * 2 * 8 + 4 * 6) / 2 * 2 + 4 / 2 * 6 * 8 * 4)
    assert e["state_bytes_per_sequence"] == state
    assert e["full_length_sequences"] == pytest.approx(e["kv_cache"] / (128 * 64 + state), rel=1e-12)
    # the same shape read as a dense model (every layer attention, no state) holds fewer sequences of 128 tokens
    dense = SimpleNamespace(**{**shape.__dict__, "layer_types": ()})
    d = P.engine_memory(dense, rollout_tp=2, utilization=0.5, gpu_mem_bytes=10 * GIB, max_len=128)
    assert d["state_bytes_per_sequence"] == 0 and d["kv_bytes_per_token"] == 4 * e["kv_bytes_per_token"]


def test_hybrid_stage_counts_follow_the_layer_pattern():
    """At PP = 3 the 3-layer pattern (linear, linear, full) puts one layer on each stage: the first stage holds a
    Gated DeltaNet layer and the embedding, the last the attention layer, the output layer and the final norm; the
    attention-scores term counts the stage's full-attention layers only."""
    import transformers as T

    hf = T.Qwen3_5TextConfig(intermediate_size=20, **HYBRID)
    shape = SimpleNamespace(num_layers=3, hidden_size=24, num_attention_heads=6, num_key_value_heads=3,
                            ffn_hidden_size=20, vocab_size=40, head_dim=12, tie_word_embeddings=False,
                            family="qwen3_5_text", layer_types=tuple(hf.layer_types), linear_num_key_heads=3,
                            linear_num_value_heads=6, linear_key_head_dim=5, linear_value_head_dim=7,
                            linear_conv_kernel_dim=5, num_experts=0)
    model = T.Qwen3_5ForCausalLM(hf)
    per_layer = [sum(p.numel() for p in layer.parameters()) for layer in model.model.layers]
    c = P.param_counts(shape, 1, 3)
    assert c["first"] == per_layer[0] + 40 * 24
    assert c["last"] == per_layer[2] + 40 * 24 + 24
    assert c["full_attention_per_stage"] == 1
    assert per_layer[0] == per_layer[1] != per_layer[2]


def test_staged_weights_of_a_hybrid_count_each_layer_by_its_kind():
    """With engines on ranks of their own, one trainer replica (TP=2) stages every layer for the one engine
    replica: the stage's Gated DeltaNet and attention layers as the counts give them, not as attention layers."""
    from mcpo_megatron.planner.phases import staged_weights_bytes

    shape = C.model_shape(OmegaConf.create({"model": {"path": "x", "arch": dict(
        num_layers=4, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, ffn_hidden_size=64,
        vocab_size=100, head_dim=16, family="qwen3_5_text", full_attention_interval=4, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=6, linear_conv_kernel_dim=4)}}))
    cfg = _cfg(**{"rollout.tensor_parallel_size": 2})
    staged = staged_weights_bytes(shape, cfg, 2, 2)
    assert staged == 2.0 * P.param_counts(shape, 2, 1)["first"]
    as_attention = SimpleNamespace(**{**shape.__dict__, "layer_types": ()})
    assert staged != staged_weights_bytes(as_attention, cfg, 2, 2)


def test_public_hybrid_shapes_have_their_published_sizes():
    """The built-in rows of Qwen3.5-27B (the language model of a 27B checkpoint), Qwen3.5-35B-A3B and
    Qwen3-Next-80B-A3B count to the totals and active parameters their names give."""
    sizes = {}
    for name in ("qwen/qwen3.5-27b", "qwen/qwen3.5-35b-a3b", "qwen/qwen3-next-80b-a3b-instruct"):
        shape = C.model_shape(OmegaConf.create({"model": {"arch": None, "path": name}}))
        assert shape.num_linear_attention_layers == 3 * shape.num_full_attention_layers
        counts = P.param_counts(shape, 1, 1)
        sizes[name] = (round(counts["total"] / 1e9, 1), round(counts["total_active"] / 1e9, 1))
    assert sizes == {"qwen/qwen3.5-27b": (26.9, 26.9), "qwen/qwen3.5-35b-a3b": (34.7, 3.5),
                     "qwen/qwen3-next-80b-a3b-instruct": (79.7, 3.9)}


def test_a_hybrid_engine_holds_more_long_sequences_than_a_dense_one():
    """Qwen3.5-27B (the built-in shape of its language model) at the 32B recipe's layout: a quarter of its layers
    keep a KV cache (16 KiB a token at rollout TP 4 against Qwen3-32B's 64) and 37 MiB of recurrent state a
    sequence, so an engine replica holds 164 sequences of the recipe's 22528 tokens against Qwen3-32B's 43
    (docs/scaling.md)."""
    cfg = C.load_config(str(REPO / "configs/qwen3_32b_mcpo.yaml"), ["model.path=Qwen/Qwen3.5-27B",
                                                                   "rollout.engine=torch"])
    hybrid = P.plan(cfg, world=32, gpu_mem_gib=80)
    dense = P.plan(C.load_config(str(REPO / "configs/qwen3_32b_mcpo.yaml")), world=32, gpu_mem_gib=80)
    assert hybrid.ok and dense.ok
    assert hybrid.engine["kv_bytes_per_token"] * 4 == dense.engine["kv_bytes_per_token"] == 64 * 1024
    # 48 GDN layers x (conv 3 x (2 x 16 x 128 + 48 x 128) / 4 bf16 + delta rule 48 / 4 x 128 x 128 fp32)
    assert hybrid.engine["state_bytes_per_sequence"] == 48 * (3 * (2 * 2048 + 6144) / 4 * 2 + 12 * 128 * 128 * 4)
    assert round(hybrid.engine["full_length_sequences"]) == 164 and round(dense.engine["full_length_sequences"]) == 43
    # the PyTorch engine it trains with today holds the whole model (26.9B parameters in bf16) on every rank
    assert any(w.startswith("rollout.engine=torch: the engine rows plan vLLM's engine") and "(50.1 GiB)" in w
               for w in hybrid.warnings), hybrid.warnings
    assert not any(w.startswith("rollout.engine=torch") for w in dense.warnings)


# ------------------------------------------------------------------ refusals

def test_refusal_names_the_overflowing_term():
    base = ["model.arch.num_layers=8", "model.arch.hidden_size=64", "model.arch.num_attention_heads=4",
            "model.arch.num_key_value_heads=2", "model.arch.ffn_hidden_size=256", "model.arch.vocab_size=1024",
            "model.arch.head_dim=16", "parallelism.tensor_model_parallel_size=2",
            "rollout.tensor_parallel_size=2", "parallelism.sequence_parallel=false", "model.dtype=bf16"]
    cfg = C.load_config(str(REPO / "configs/qwen3_8b_mcpo.yaml"), base + ["trainer.max_tokens_per_microbatch=4000000"])
    res = P.plan(cfg, world=8, gpu_mem_gib=1.0, reserve_gib=0.0, shape=C.model_shape(cfg))
    assert not res.ok
    assert any("training phase" in e and "'activations'" in e and "max_tokens_per_microbatch" in e
               for e in res.errors), res.errors

    cfg2 = C.load_config(str(REPO / "configs/qwen3_8b_mcpo.yaml"), ["rollout.gpu_memory_utilization=0.95",
                                                                  "trainer.offload.enable=false"])
    res2 = P.plan(cfg2, world=8, gpu_mem_gib=80)
    assert any("rollout phase" in e and "'engine'" in e and "gpu_memory_utilization" in e for e in res2.errors)
    # with the training state offloaded 0.95 fits (76 + 3 GiB of 80); 0.99 does not
    assert P.plan(C.load_config(str(REPO / "configs/qwen3_8b_mcpo.yaml"), ["rollout.gpu_memory_utilization=0.95"]),
                  world=8, gpu_mem_gib=80).ok
    cfg4 = C.load_config(str(REPO / "configs/qwen3_8b_mcpo.yaml"), ["rollout.gpu_memory_utilization=0.99"])
    assert any("rollout phase" in e and "'engine'" in e for e in P.plan(cfg4, world=8, gpu_mem_gib=80).errors)

    cfg3 = C.load_config(str(REPO / "configs/qwen3_8b_mcpo.yaml"), ["rollout.gpu_memory_utilization=0.12"])
    res3 = P.plan(cfg3, world=8, gpu_mem_gib=80)
    assert any(e.startswith("kv_cache") for e in res3.errors), res3.errors


def _plan_cli(*args):
    return subprocess.run([sys.executable, "-m", "mcpo_megatron.cli", "plan", *args], cwd=REPO, text=True,
                          capture_output=True, timeout=120)


def test_cli_refuses_with_exit_1_and_names_term():
    r = _plan_cli("configs/qwen3_8b_mcpo.yaml", "rollout.gpu_memory_utilization=0.99", "--nodes", "1")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "does not fit" in r.stderr and "'engine'" in r.stderr
    assert "| optimizer" in r.stdout and "| activations" in r.stdout      # the table is still printed


def test_cli_invalid_layout_exit_1():
    # 3 GPUs cannot hold TP=2
    r = _plan_cli("configs/qwen3_8b_mcpo.yaml", "--nodes", "1", "--gpus-per-node", "3")
    assert r.returncode == 1
    assert "tensor_model_parallel_size" in r.stderr


# ------------------------------------------------------------------ recipes on 8 x H100-80GB

# The recipes as they are (trainer.offload on, the engine at what it leaves free) and the 8B and 14B recipes with
# the state resident, where the engine fits at 0.5 of the GPU beside it (docs/scaling.md).
RECIPES = [
    ("configs/qwen3_8b_mcpo.yaml", 1, []),
    ("configs/qwen3_14b_mcpo.yaml", 2, []),
    ("configs/qwen3_8b_mcpo.yaml", 1, ["rollout.gpu_memory_utilization=0.5", "trainer.offload.enable=false"]),
    ("configs/qwen3_14b_mcpo.yaml", 2, ["rollout.gpu_memory_utilization=0.5", "trainer.offload.enable=false"]),
    ("configs/qwen3_32b_mcpo.yaml", 4, []),
    ("configs/qwen3_32b_dapo.yaml", 4, []),
    ("configs/qwen3_30b_a3b_mcpo.yaml", 2, []),
]


@pytest.mark.parametrize("path,nodes,overrides", RECIPES,
                         ids=[r[0].split("/")[-1] + ("-resident" if r[2] else "") for r in RECIPES])
def test_recipes_fit_on_h100_80gb(path, nodes, overrides):
    r = _plan_cli(path, *overrides, "--nodes", str(nodes), "--gpus-per-node", "8", "--gpu-mem-gb", "80")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "plan OK" in r.stderr
    cfg = C.load_config(str(REPO / path), overrides)
    res = P.plan(cfg, world=8 * nodes, gpu_mem_gib=80)
    assert res.ok and res.engine["full_length_sequences"] >= 1
    assert _total_gib(res.training) < 80 and _total_gib(res.rollout) < 80


def test_qwen3_30b_a3b_on_one_node_is_refused_naming_the_optimizer():
    r = _plan_cli("configs/qwen3_30b_a3b_mcpo.yaml", "parallelism.expert_model_parallel_size=4", "--nodes", "1")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "'optimizer'" in r.stderr and "expert-DP=1" in r.stderr


def _total_gib(terms):
    return P.Plan.total(terms) / GIB


# ------------------------------------------------------------------ against megatron-core's tensors

MEASURE = textwrap.dedent("""
    import json, sys, torch
    from mcpo_megatron.parallel.distributed import init_distributed
    from mcpo_megatron.models.tiny import tiny_hf_config
    from mcpo_megatron.models.policy import MegatronPolicy
    from mcpo_megatron.models.policy_settings import PolicySettings

    info = init_distributed(1, 1)
    hf = tiny_hf_config(sys.argv[2])
    pol = MegatronPolicy(None, PolicySettings(dtype=torch.bfloat16), hf_config=hf, load_weights=False, parallel_info=info)
    params = list(pol.model.parameters())
    out = {"params": sum(p.numel() for p in params),
           "weights": sum(p.numel() * p.element_size() for p in params),
           "grads": sum(b.grad_data.numel() * b.grad_data.element_size() for b in pol.ddp.buffers)}
    for p in params:
        p.main_grad.normal_()
    pol.optimizer.step()            # Adam creates its moments on the first step
    opt, seen = 0, set()
    for o in pol.optimizer.chained_optimizers:
        for group in o.shard_fp32_from_float16_groups:
            opt += sum(t.numel() * t.element_size() for t in group)
        for state in o.optimizer.state.values():
            for v in state.values():
                if torch.is_tensor(v) and v.numel() > 1 and id(v) not in seen:
                    seen.add(id(v)); opt += v.numel() * v.element_size()
    out["optimizer"] = opt

    # activations: bytes the decoder saves for backward (autograd saved-tensor hooks), bf16, one sequence
    model = pol.model
    param_ptrs = {p.untyped_storage().data_ptr() for p in params}
    layers = list(model.decoder.layers)
    current = [0]
    for i, layer in enumerate(layers):   # attribute each saved tensor to the layer whose forward saved it
        layer.register_forward_pre_hook(lambda mod, args, i=i: current.__setitem__(0, i))
    def saved_bytes(s):
        # bytes each decoder layer saves for backward on one sequence of s tokens
        ids = torch.randint(0, hf.vocab_size, (1, s)); pos = torch.arange(s)[None]
        h = model.embedding(input_ids=ids, position_ids=pos).detach().requires_grad_(True)
        saved = {}
        def pack(t):
            key = (current[0], t.untyped_storage().data_ptr())
            saved[key] = max(saved.get(key, 0), t.untyped_storage().nbytes())
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model.decoder(hidden_states=h, attention_mask=None, rotary_pos_emb=model.rotary_pos_emb(s))
        return [sum(v for (i, k), v in saved.items() if i == layer and k not in param_ptrs)
                for layer in range(len(layers))]
    s = 32
    act, act_2s, act_3s = saved_bytes(s), saved_bytes(2 * s), saved_bytes(3 * s)
    kinds = list(getattr(hf, "layer_types", None) or ["full_attention"] * hf.num_hidden_layers)
    # per kind of layer, the mean over its layers: bytes per token at s tokens, and (full attention) the s^2
    # part c2 s^2 of saved bytes = c0 + c1 s + c2 s^2, the unfused attention's probabilities: half the second
    # difference over s, 2s, 3s (c0: the 1 + weight copies of zero-centred norms, a few hundred bytes)
    for kind in set(kinds):
        mine = [i for i, k in enumerate(kinds) if k == kind]
        out[f"act_per_token_layer/{kind}"] = sum(act[i] for i in mine) / s / len(mine)
        if kind == "full_attention":
            out["score_bytes_per_layer_at_s"] = sum(act_3s[i] - 2 * act_2s[i] + act[i] for i in mine) / 2 / len(mine)
    out["s"] = s
    out["arch"] = dict(num_layers=hf.num_hidden_layers, hidden_size=hf.hidden_size,
                       num_attention_heads=hf.num_attention_heads, num_key_value_heads=hf.num_key_value_heads,
                       ffn_hidden_size=hf.intermediate_size, vocab_size=hf.vocab_size, head_dim=hf.head_dim,
                       tie_word_embeddings=hf.tie_word_embeddings, family=sys.argv[2],
                       num_experts=getattr(hf, "num_experts", 0), num_experts_per_tok=getattr(hf, "num_experts_per_tok", 0),
                       moe_ffn_hidden_size=getattr(hf, "moe_intermediate_size", 0),
                       layer_types=list(getattr(hf, "layer_types", None) or []) if sys.argv[2] == "qwen3_5" else [],
                       **{k: getattr(hf, k, 0) for k in ("linear_num_key_heads", "linear_num_value_heads",
                                                         "linear_key_head_dim", "linear_value_head_dim",
                                                         "linear_conv_kernel_dim")})
    json.dump(out, open(sys.argv[1], "w"))
""")


@pytest.fixture(scope="module", params=["qwen3", "qwen3_moe", "qwen3_5"])
def measured(tmp_path_factory, request):
    d = tmp_path_factory.mktemp("plan_measure")
    (d / "measure.py").write_text(MEASURE)
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    import os
    r = subprocess.run([sys.executable, str(d / "measure.py"), str(d / "out.json"), request.param], cwd=REPO,
                       text=True, capture_output=True, timeout=300, env={**os.environ, **env})
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads((d / "out.json").read_text())


def test_weights_grads_optimizer_match_megatron_tensors(measured):
    """Tight: the planner's counts against the bytes of a bf16 megatron-core model, its DDP gradient buffer
    and its distributed optimizer (world of one, so DP = 1). Differences are megatron's buffer padding and its
    fp32 norm weights on the CPU path (< 1%)."""
    shape = SimpleNamespace(**measured["arch"])
    cfg = _cfg(**{"parallelism.tensor_model_parallel_size": 1, "trainer.max_tokens_per_microbatch": 32})
    t = P.estimate_training_memory(shape, cfg, world=1)
    assert P.param_counts(shape, 1, 1)["stage_max"] == measured["params"]
    for key in ("weights", "grads", "optimizer"):
        assert t[key].bytes == pytest.approx(measured[key], rel=0.01), key


def test_activation_estimate_is_a_lower_bound_within_3x_on_cpu(measured):
    """Loose: the estimate assumes fused GPU kernels (FlashAttention, fused norms and SwiGLU); megatron's local
    CPU layers additionally keep fp32 norm upcasts, separate SiLU/product inputs and the s x s attention
    probabilities, so the CPU measurement is larger, but by less than 3x at 32 tokens."""
    shape = SimpleNamespace(**measured["arch"])
    est = P.activation_bytes_per_token_layer(shape, 1, False, 2)
    got = measured["act_per_token_layer/full_attention"]
    assert est <= got <= 3 * est, (est, got)


@pytest.mark.parametrize("measured", ["qwen3_5"], indirect=True)
def test_gated_deltanet_activation_estimate_is_a_lower_bound_on_cpu(measured):
    """A hybrid decoder's Gated DeltaNet layers: the estimate counts what the fused GPU kernels keep (the chunked
    delta rule recomputes its chunk states in backward); the plain-torch chunked recurrence that runs on CPU keeps
    every chunk's matrices in fp32, so only the lower bound holds here."""
    shape = SimpleNamespace(**measured["arch"])
    est = P.activation_bytes_per_token_layer(shape, 1, False, 2, kind="linear_attention")
    full = P.activation_bytes_per_token_layer(shape, 1, False, 2, kind="full_attention")
    assert est != full
    assert est <= measured["act_per_token_layer/linear_attention"], (est, measured)


def test_local_spec_attention_scores_match_megatron_saved_tensors(measured):
    """The s^2 part of what megatron's local layers save for backward (bf16: fp32 softmax output + its bf16 copy
    per head, the causal mask) is the planner's attention_scores term for a one-sequence micro-batch."""
    shape = SimpleNamespace(**measured["arch"])
    s = measured["s"]
    want = P.attention_score_bytes(shape, 1, s, s, dtype_bytes=2)
    assert measured["score_bytes_per_layer_at_s"] == want


def test_attention_scores_term_only_with_the_local_spec():
    """T x min(T, S) pairs per head and layer, 6 bytes each in bf16 (4 in fp32), plus a min(T, S)^2-byte mask per
    layer, for the layers and micro-batches in flight; one layer under recomputation; absent with auto (planned
    as Transformer Engine's FlashAttention)."""
    shape = _shape(num_layers=4)                           # 4 heads / 2 KV heads
    local = {"model.transformer_impl": "local", "data.max_response_length": 64}    # S = 32 + 64 = 96
    t = P.estimate_training_memory(shape, _cfg(**local), world=2)          # TP=2: 2 heads per rank, T = 128
    layer = 2 * 128 * 96 * 6 + 96 * 96
    assert t["attention_scores"].bytes == 4 * layer
    pp = P.estimate_training_memory(shape, _cfg(**local, **{"parallelism.pipeline_model_parallel_size": 2,
                                                             "parallelism.tensor_model_parallel_size": 1}), world=2)
    assert pp["attention_scores"].bytes == 2 * 2 * (4 * 128 * 96 * 6 + 96 * 96)   # 2 layers/stage x 2 in flight
    fp32 = P.estimate_training_memory(shape, _cfg(**local, **{"model.dtype": "fp32"}), world=2)
    assert fp32["attention_scores"].bytes == 4 * (2 * 128 * 96 * 4 + 96 * 96)
    rc = P.estimate_training_memory(shape, _cfg(**local, **{"model.recompute_activations": True}), world=2)
    assert rc["attention_scores"].bytes == layer
    short = P.estimate_training_memory(shape, _cfg(**{**local, "data.max_response_length": 512}), world=2)
    assert short["attention_scores"].bytes == 4 * (2 * 128 * 128 * 6 + 128 * 128)   # S > T: bounded by T
    assert "attention_scores" not in P.estimate_training_memory(shape, _cfg(), world=2)


def test_plan_counts_the_attention_scores_in_the_training_phase():
    cfg = C.load_config(str(REPO / "configs/qwen3_8b_mcpo.yaml"), ["model.transformer_impl=local"])
    res = P.plan(cfg, world=8, gpu_mem_gib=80)
    names = [t.name for t in res.training]
    assert names.index("attention_scores") == names.index("activations") + 1
    base = P.plan(C.load_config(str(REPO / "configs/qwen3_8b_mcpo.yaml"), []), world=8, gpu_mem_gib=80)
    assert "attention_scores" not in [t.name for t in base.training]


def test_preempt_lead_hand_computed():
    """Worst case after a signal: the old-log-prob forward plus ppo_epochs x (forward + backward) over every
    sequence at full length, at world x peak x MFU, plus 14 bytes per parameter written at the given bandwidth."""
    shape = _shape(num_experts=0)
    cfg = _cfg(**{"data.train_batch_size": 3, "rollout.n": 2, "data.max_response_length": 8,
                  "algorithm.ppo_epochs": 2})
    h, a, k, d, f, layers, v = 8, 4, 2, 2, 12, 2, 16
    s = 32 + 8
    per_token = layers * (2 * h * a * d + 2 * 2 * h * k * d + 2 * a * d * h + 3 * 2 * h * f)
    forward = s * per_token + layers * 2 * 2 * a * d * s * (s + 1) // 2 + 2 * h * v * s
    flops = 6 * (1 + 2 * 3) * forward
    lead = P.estimate_preempt_lead(shape, cfg, world=4, peak_flops=1e9, mfu=0.5, fs_write_gbps=1e-6)
    assert lead["train_flops"] == pytest.approx(flops, rel=1e-12)
    assert lead["train_s"] == pytest.approx(flops / (4 * 1e9 * 0.5))
    params = P.param_counts(shape, 1, 1)["total"]
    assert lead["checkpoint_bytes"] == params * 14 and lead["checkpoint_s"] == pytest.approx(params * 14 / 1e3)
    assert lead["suggested_lead_s"] % 60 == 0 and lead["suggested_lead_s"] >= 1.25 * lead["lead_s"] + 60
    assert lead["lead_s"] == pytest.approx(lead["train_s"] + lead["checkpoint_s"]) and "generate_s" not in lead
    # separate placement: the checkpoint also waits for the next step's batch, generated while the step trains
    # (with a KV cache, about one forward of every sequence: accounting.model_flops(kind="generate"))
    gen = P.estimate_preempt_lead(shape, cfg, world=4, peak_flops=1e9, mfu=0.5, fs_write_gbps=1e-6, engine_world=2,
                                  gen_mfu=0.01)
    assert gen["generate_flops"] == pytest.approx(3 * 2 * forward, rel=0.2)
    assert gen["generate_s"] == pytest.approx(gen["generate_flops"] / (2 * 1e9 * 0.01))
    assert gen["generate_s"] > gen["train_s"]
    assert gen["lead_s"] == pytest.approx(gen["generate_s"] + gen["checkpoint_s"])
    with pytest.raises(ValueError, match="mfu"):
        P.estimate_preempt_lead(shape, cfg, world=4, peak_flops=1e9, mfu=0.0)


def test_cli_prints_the_preemption_lead():
    r = _plan_cli("configs/qwen3_14b_mcpo.yaml", "rollout.gpu_memory_utilization=0.5", "--nodes", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "preemption lead" in r.stdout and "SBATCH_SIGNAL=B:USR1@" in r.stdout


def test_routing_replay_record_hand_computed():
    """Qwen3-30B-A3B recipe (48 MoE layers, top-8, 128 experts -> int16) at 2,048 + 20,480-token sequences."""
    cfg = C.load_config(str(REPO / "configs/qwen3_30b_a3b_mcpo.yaml"), ["model.moe_routing_replay=r2"])
    shape = C.model_shape(cfg)
    r = P.estimate_routing_record(shape, cfg, world=16)
    assert r["bytes_per_token"] == 48 * 8 * 2
    assert r["sequences"] == 128 * 16 // 8                    # this DP rank's share (DP = 16 / TP 2)
    assert r["host_bytes"] == 256 * (2048 + 20480) * 768      # 4.12 GiB
    assert r["device_bytes"] == 24576 / 2 * 48 * 8 * 8         # int64 indices, sequence-parallel slice
    on = P.plan(cfg, world=16, gpu_mem_gib=80)
    term = [t for t in on.training if t.name == "routing"][0]
    assert term.bytes == r["device_bytes"] and "4.12 GiB per rank" in term.note
    # R3: a rank holds its rollout replica's routing (16 ranks / rollout TP 4 = 4 replicas: 2048 / 4 = 512
    # sequences), or its share plus one transfer chunk (256 + 64) when that is more
    cfg.model.moe_routing_replay = "r3"
    assert P.estimate_routing_record(shape, cfg, world=16)["sequences"] == 512      # 8.25 GiB (all 2048: 33)
    cfg.rollout.tensor_parallel_size = 1  # 16 replicas of 128 sequences: the share and a chunk
    assert P.estimate_routing_record(shape, cfg, world=16)["sequences"] == 256 + 64
    cfg.rollout.tensor_parallel_size = 4
    cfg.model.moe_routing_replay = "off"
    assert P.estimate_routing_record(shape, cfg, world=16) is None
    assert all(t.name != "routing" for t in P.plan(cfg, world=16, gpu_mem_gib=80).training)


# ------------------------------------------------------------------ separate placement


def test_separate_placement_plans_training_and_engine_ranks_apart():
    """Training ranks: the training state over world - rollout.ranks (DP from those), no engine; engine ranks: the
    engine and one bucket in transit; each training rank stages its shards of the engines' weights in host memory. The engine
    takes rollout.dedicated_gpu_memory_utilization (0.9), not the recipe's colocated share, as it is built; nothing
    is offloaded (no engine shares the training GPUs)."""
    over = ["rollout.placement=separate", "rollout.ranks=8", "reshard.bucket_mb=256"]
    cfg = C.load_config(str(REPO / "configs/qwen3_8b_mcpo.yaml"), over)
    res = P.plan(cfg, world=24, gpu_mem_gib=80)
    assert res.ok and res.separate and (res.train_world_size, res.rollout_world_size) == (16, 8)
    shape = C.model_shape(cfg)
    want = P.estimate_training_memory(shape, cfg, 16)
    got = {t.name: t.bytes for t in res.training}
    assert "engine" not in got and got["optimizer"] == want["optimizer"].bytes  # sharded over DP = 16 / TP 2
    assert {t.name for t in res.rollout} == {"engine", "receive_bucket", "reserve"}
    assert {t.name: t.bytes for t in res.rollout}["receive_bucket"] == 256 * 2**20
    assert cfg.rollout.gpu_memory_utilization is None  # the recipe's colocated share: null
    assert {t.name: t.bytes for t in res.rollout}["engine"] == pytest.approx(0.9 * 80 * GIB)
    assert {t.name: t.note for t in res.rollout}["engine"].startswith("rollout.dedicated_gpu_memory_utilization=0.9:")
    # each training rank stages its shards of the engine replicas' weights (8 ranks / rollout TP 2 = 4 replicas) in
    # bf16: replica r's layer l from trainer replica (r + l + 1) mod 8, its embedding, head and final norm from
    # r mod 8; the busiest is trainer replica 3: 19 layers (5 + 5 + 5 + 4 over the replicas) and replica 3's
    # embedding, head and norm, at TP 2; and sends a version through one bucket on its GPU
    layer = P.layer_params_per_rank(shape, 2)
    outside = 2 * (shape.vocab_size * shape.hidden_size // 2) + shape.hidden_size
    assert res.host_weights_bytes == 2 * (19 * layer + outside)
    assert {t.name: t.bytes for t in res.training}["send_bucket"] == 256 * 2**20
    assert res.offload is None and res.rollout_without_offload is None
    text = P.format_plan(res)
    assert "| training ranks (16)" in text and "| engine ranks (8)" in text
    assert "host: each training rank stages its shards of the newest weights for the engines, at most 4.6 GiB" in text


def test_split_suggestion_balances_generation_and_training():
    """By hand, the CPU demo (16 sequences per mini-batch, which the training ranks' DP must divide) on 8 ranks at
    TP=1, with 1000 device-s of generation and 3000 of training: R engine ranks take 1000/R s, the 8 - R others
    3000/(8 - R) s; the allowed R are 4, 6, 7 (8 - R in 4, 2, 1), and R=4 is fastest: max(250, 750) = 750 s."""
    cfg = C.load_config(str(REPO / "configs/cpu_smollm2_arith.yaml"), ["parallelism.tensor_model_parallel_size=1"])
    rows = P.suggest_split(cfg, 8, gen_device_s=1000.0, train_device_s=3000.0, gpus_per_node=2)
    assert [r["ranks"] for r in rows] == [4, 6, 7]
    best = rows[0]
    assert (best["generate_s"], best["train_s"], best["overlapped_s"], best["sequential_s"]) == (250.0, 750.0, 750.0,
                                                                                                 1000.0)
    assert [r["nodes"] for r in rows] == [2, 3, None]
    assert "suggested: rollout.ranks=4; in whole nodes: ROLLOUT_NODES=2" in P.format_split(rows, 8, "test")


def test_plan_cli_suggests_a_split_from_a_measured_run(tmp_path):
    """--measured: the phase seconds of a run's steps (after the first) times the ranks they ran on."""
    run = tmp_path / "run"
    run.mkdir()
    demo = str(REPO / "configs/cpu_smollm2_arith.yaml")
    measured = ["rollout.placement=separate", "rollout.ranks=1", "parallelism.tensor_model_parallel_size=1"]
    (run / "config.yaml").write_text(C.to_yaml(C.load_config(demo, measured)))
    steps = [{"step": 1, "time/engine_generate": 99.0, "time/old_logprobs": 99.0, "time/train": 99.0}] + [
        {"step": s, "time/engine_generate": 30.0, "time/old_logprobs": 10.0, "time/train": 20.0} for s in (2, 3)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    # measured on 1 + 1 ranks: 30 device-s of each phase. On 2 nodes x 2 the training ranks' DP must divide 16:
    # 2 + 2 (15 s each) or 3 + 1 (10 and 30 s)
    r = _plan_cli(demo, "rollout.placement=separate", "rollout.ranks=2", "parallelism.tensor_model_parallel_size=1",
                  "--nodes", "2", "--gpus-per-node", "2", "--measured", str(run), "--measured-world", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"measured: {run} (2 steps on 2 ranks)" in r.stdout
    assert "| 2 | 1 | 15 | 15 | 15 | 30 |" in r.stdout and "| 3 | - | 10 | 30 | 30 | 40 |" in r.stdout
    assert "suggested: rollout.ranks=2; in whole nodes: ROLLOUT_NODES=1" in r.stdout
    bad = _plan_cli(demo, "--measured", str(run))
    assert bad.returncode == 2 and "--measured-world" in bad.stderr


# ------------------------------------------------------------------ trainer.offload


def test_offload_frees_the_rollout_phase_and_the_engine_takes_it():
    """14B recipe on 2 nodes: with offload the rollout phase holds none of the training state (weights and Adam
    state copied to host, gradients released), so a null gpu_memory_utilization is (80 - 3) / 80 rounded down
    = 0.96; the plan also shows the phase without offload (the engine at the largest share beside the 31 GiB of
    state), the pinned host memory per node and the transfer time at the stated bandwidth."""
    cfg = C.load_config(str(REPO / "configs/qwen3_14b_mcpo.yaml"))
    res = P.plan(cfg, world=16, gpu_mem_gib=80, gpus_per_node=8, host_mem_gib=2048, offload_gbps=25)
    assert res.ok, res.errors
    train = {t.name: t for t in res.training}
    rollout = {t.name: t for t in res.rollout}
    assert rollout["weights"].bytes == rollout["grads"].bytes == rollout["optimizer"].bytes == 0
    assert res.engine["utilization"] == 0.96 and rollout["engine"].bytes == pytest.approx(0.96 * 80 * GIB)
    state = sum(train[k].bytes for k in ("weights", "grads", "optimizer"))
    without = {t.name: t for t in res.rollout_without_offload}
    assert sum(without[k].bytes for k in ("weights", "grads", "optimizer")) == state
    largest = math.floor((80 * GIB - 3 * GIB - state) / (80 * GIB) * 100) / 100
    assert res.engine_without_offload["utilization"] == largest
    eng = res.engine
    assert eng["kv_cache"] == pytest.approx(0.96 * 80 * GIB - eng["weights"] - P.ENGINE_ALLOWANCE_GIB * GIB)
    assert eng["kv_tokens"] > 1.8 * res.engine_without_offload["kv_tokens"]
    o = res.offload
    assert o["copied_bytes"] == train["weights"].bytes + train["optimizer"].bytes
    assert o["released_bytes"] == train["grads"].bytes
    assert o["host_per_node_bytes"] == 8 * o["copied_bytes"]
    assert o["seconds"] == pytest.approx(o["copied_bytes"] / 25e9)
    text = P.format_plan(res)
    assert "| rollout phase without offload" in text and "engine (rollout TP=4), with offload:" in text
    assert "host memory per node: 8 x" in text and "(--offload-gbps)" in text


def test_offload_parts_stay_when_switched_off():
    """moments=false: Adam's m and v (8 of the optimizer term's 12 bytes per parameter) stay in the rollout phase;
    buffers=false: the weights and gradients stay."""
    base = C.load_config(str(REPO / "configs/qwen3_14b_mcpo.yaml"))
    opt = {t.name: t for t in P.plan(base, world=16, gpu_mem_gib=80).training}["optimizer"].bytes
    cfg = C.load_config(str(REPO / "configs/qwen3_14b_mcpo.yaml"), ["trainer.offload.moments=false",
                                                                    "trainer.offload.buffers=false"])
    res = P.plan(cfg, world=16, gpu_mem_gib=80)
    rollout = {t.name: t for t in res.rollout}
    assert rollout["optimizer"].bytes == pytest.approx(opt * 8 / 12)
    assert rollout["weights"].bytes > 0 and rollout["grads"].bytes > 0
    assert res.offload["copied_bytes"] == pytest.approx(opt * 4 / 12) and res.offload["released_bytes"] == 0
    assert res.engine["utilization"] < 0.96


def test_host_memory_that_cannot_hold_the_copies_is_refused():
    cfg = C.load_config(str(REPO / "configs/qwen3_14b_mcpo.yaml"))
    res = P.plan(cfg, world=16, gpu_mem_gib=80, host_mem_gib=64)
    assert any(e.startswith("host memory: trainer.offload pins") and "--host-mem-gb" in e for e in res.errors)
    r = _plan_cli("configs/qwen3_14b_mcpo.yaml", "--nodes", "2", "--host-mem-gb", "64")
    assert r.returncode == 1 and "host memory" in r.stderr
    assert _plan_cli("configs/qwen3_14b_mcpo.yaml", "--nodes", "2", "--offload-gbps", "0").returncode == 2


def test_runtime_share_is_the_plans():
    """The trainer resolves a null gpu_memory_utilization with the plan's rule for its GPU's memory."""
    cfg = C.load_config(str(REPO / "configs/qwen3_14b_mcpo.yaml"))
    assert P.colocated_engine_share(cfg, 16, 80 * GIB) == P.plan(cfg, world=16, gpu_mem_gib=80).engine["utilization"]
    assert P.colocated_engine_share(cfg, 16, 80 * GIB, cuda=False) == P.DEFAULT_UTILIZATION  # off: 0.6
