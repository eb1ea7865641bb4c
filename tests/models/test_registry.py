"""HF config -> MegatronShape -> TransformerConfig: the mapped fields, and errors that name the offending field."""

import math

import pytest
import torch

from mcpo_megatron.models import megatron_config, registry
from mcpo_megatron.models.megatron_config import ParallelLayout
from mcpo_megatron.models.registry import UnsupportedModelError
from mcpo_megatron.models.tiny import tiny_hf_config


def test_qwen3_config_fields():
    hf = tiny_hf_config("qwen3")
    cfg = megatron_config.transformer_config(hf, ParallelLayout(tp=2, pp=2), transformer_impl="local")
    assert (cfg.num_layers, cfg.hidden_size, cfg.ffn_hidden_size) == (4, 64, 128)
    assert (cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels) == (4, 2, 16)
    assert cfg.normalization == "RMSNorm" and cfg.layernorm_epsilon == hf.rms_norm_eps
    assert cfg.gated_linear_unit and cfg.activation_func is torch.nn.functional.silu
    assert not cfg.add_bias_linear and not cfg.add_qkv_bias and cfg.qk_layernorm
    assert not cfg.rotary_interleaved and not cfg.apply_rope_fusion
    assert cfg.attention_dropout == 0.0 and cfg.hidden_dropout == 0.0
    assert (cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size) == (2, 2)
    assert cfg.params_dtype == torch.float32 and cfg.pipeline_dtype == torch.float32
    kw = megatron_config.gpt_model_kwargs(hf)
    assert kw["rotary_base"] == 1000000.0 and kw["position_embedding_type"] == "rope"
    assert kw["share_embeddings_and_output_weights"] is False and kw["vocab_size"] == 256


def test_qwen2_bias_and_llama_tied():
    q2 = megatron_config.transformer_config(tiny_hf_config("qwen2"), transformer_impl="local", dtype=torch.bfloat16)
    assert q2.add_qkv_bias and not q2.qk_layernorm and q2.bf16 and q2.params_dtype == torch.bfloat16
    assert q2.kv_channels == 16  # hidden / heads when head_dim is absent
    ll = tiny_hf_config("llama-tied")
    assert megatron_config.gpt_model_kwargs(ll)["share_embeddings_and_output_weights"] is True
    assert not megatron_config.transformer_config(ll, transformer_impl="local").qk_layernorm


def test_query_groups_padded_for_tp():
    hf = tiny_hf_config("llama-tied", num_attention_heads=9, num_key_value_heads=3, hidden_size=72, head_dim=8)
    cfg = megatron_config.transformer_config(hf, ParallelLayout(tp=2), transformer_impl="local")
    assert (cfg.num_query_groups, cfg.num_attention_heads) == (4, 12)
    shape = registry.megatron_shape(hf, 2)
    assert (shape.hf_heads, shape.hf_kv_heads, shape.padded_groups) == (9, 3, 1)


def test_layer_spec_local_on_cpu():
    from megatron.core.transformer.identity_op import IdentityOp

    spec = megatron_config.layer_spec(tiny_hf_config("qwen3"), transformer_impl="auto")
    attn = spec.submodules.self_attention.submodules
    assert attn.q_layernorm is not IdentityOp and attn.k_layernorm is not IdentityOp
    spec = megatron_config.layer_spec(tiny_hf_config("llama"), transformer_impl="local")
    assert spec.submodules.self_attention.submodules.q_layernorm is IdentityOp
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="transformer_impl"):
            megatron_config.layer_spec(tiny_hf_config("llama"), transformer_impl="transformer_engine")


def with_attr(cfg, **kv):
    for k, v in kv.items():
        setattr(cfg, k, v)
    return cfg


@pytest.mark.parametrize("make,field", [
    (lambda: {"model_type": "mistral"}, "model_type"),
    (lambda: with_attr(tiny_hf_config("qwen2"), use_sliding_window=True), "use_sliding_window"),
    (lambda: with_attr(tiny_hf_config("qwen3"), layer_types=["full_attention", "sliding_attention"] * 2),
     "layer_types"),
    (lambda: with_attr(tiny_hf_config("llama"), attention_bias=True), "attention_bias"),
    (lambda: with_attr(tiny_hf_config("llama"), mlp_bias=True), "mlp_bias"),
    (lambda: with_attr(tiny_hf_config("qwen3"), num_experts=8), "num_experts"),
    (lambda: with_attr(tiny_hf_config("llama"), hidden_act="gelu"), "hidden_act"),
    (lambda: with_attr(tiny_hf_config("llama"),
                       rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 4.0}),
     "rope_parameters.rope_type"),
    (lambda: with_attr(tiny_hf_config("llama"), rope_parameters={
        "rope_type": "llama3", "rope_theta": 5e5, "factor": 32.0, "low_freq_factor": 2.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}), "rope_parameters.low_freq_factor"),
    (lambda: with_attr(tiny_hf_config("llama"), rope_parameters={
        "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "original_max_position_embeddings": 4096}),
     "rope_parameters.original_max_position_embeddings"),
    (lambda: with_attr(tiny_hf_config("qwen3_moe"), mlp_only_layers=[0]), "mlp_only_layers"),
    (lambda: with_attr(tiny_hf_config("qwen3_moe"), decoder_sparse_step=2), "decoder_sparse_step"),
    (lambda: with_attr(tiny_hf_config("qwen3_moe"), num_experts_per_tok=1), "norm_topk_prob"),
    (lambda: with_attr(tiny_hf_config("qwen3_moe"), num_experts_per_tok=5), "num_experts_per_tok"),
    (lambda: {**tiny_hf_config("llama").to_dict(), "rope_parameters": None,
              "rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling.rope_type"),
    (lambda: with_attr(tiny_hf_config("qwen3"), architectures=["Qwen3MoeForCausalLM"]), "architectures"),
])
def test_unsupported_configs_name_the_field(make, field):
    with pytest.raises(UnsupportedModelError, match=field.replace(".", r"\.")):
        registry.megatron_shape(make())


def test_tp_divisibility_errors_name_the_field():
    with pytest.raises(UnsupportedModelError, match="vocab_size"):
        registry.megatron_shape(tiny_hf_config("qwen3", vocab_size=255), 2)
    with pytest.raises(UnsupportedModelError, match="num_hidden_layers"):
        megatron_config.transformer_config(tiny_hf_config("qwen3", num_hidden_layers=3), ParallelLayout(pp=2),
                                           transformer_impl="local")


def test_qwen3_moe_router_and_experts():
    hf = tiny_hf_config("qwen3_moe")
    cfg = megatron_config.transformer_config(hf, ParallelLayout(tp=2, ep=2, sequence_parallel=True),
                                             transformer_impl="local")
    assert (cfg.num_moe_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size) == (4, 2, 32)
    assert cfg.moe_router_score_function == "softmax"
    assert not cfg.moe_router_pre_softmax  # top-k logits then softmax over k == softmax, top-k, renormalise
    assert cfg.moe_router_load_balancing_type == "none" and cfg.moe_token_dispatcher_type == "alltoall"
    assert (cfg.expert_model_parallel_size, cfg.expert_tensor_parallel_size) == (2, 2) and cfg.sequence_parallel
    assert not cfg.moe_grouped_gemm and cfg.qk_layernorm
    unnormalised = megatron_config.transformer_config(tiny_hf_config("qwen3_moe", norm_topk_prob=False),
                                                      transformer_impl="local")
    assert unnormalised.moe_router_pre_softmax  # softmax over all experts, top-k, no renormalisation
    shape = registry.megatron_shape(hf, 2, 2)
    assert shape.is_moe and shape.num_local_experts == 2 and shape.moe_topk == 2
    with pytest.raises(UnsupportedModelError, match="num_experts"):
        registry.megatron_shape(hf, 1, 3)
    with pytest.raises(UnsupportedModelError, match="moe_intermediate_size"):
        registry.megatron_shape(tiny_hf_config("qwen3_moe", moe_intermediate_size=33), 2)
    with pytest.raises(UnsupportedModelError, match="num_experts"):
        registry.megatron_shape(tiny_hf_config("qwen3"), 1, 2)  # EP without experts


def test_moe_layer_specs():
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from mcpo_megatron.models.local_norm import LocalRMSNorm

    spec = megatron_config.layer_spec(tiny_hf_config("qwen3_moe"), transformer_impl="local")
    assert spec.submodules.mlp.module is MoELayer
    assert spec.submodules.mlp.submodules.experts.module is SequentialMLP
    assert spec.submodules.pre_mlp_layernorm is LocalRMSNorm and spec.submodules.input_layernorm is LocalRMSNorm


def test_rope_scaling_llama3_and_yarn():
    ll = tiny_hf_config("llama", rope_theta=5e5, rope_parameters={
        "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192})
    kw = megatron_config.gpt_model_kwargs(ll)
    assert kw["rope_scaling"] is True and kw["rope_scaling_factor"] == 8.0 and kw["rotary_base"] == 5e5
    assert kw["position_embedding_type"] == "rope"
    yarn = tiny_hf_config("qwen3", rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                                    "original_max_position_embeddings": 32})
    assert megatron_config.gpt_model_kwargs(yarn)["position_embedding_type"] == "yarn"
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        _yarn_get_concentration_factor_from_config,
    )

    cfg = megatron_config.transformer_config(yarn, transformer_impl="local")
    factor = 0.1 * math.log(4.0) + 1.0  # transformers' default attention factor for YaRN
    assert cfg.softmax_scale is None
    assert _yarn_get_concentration_factor_from_config(cfg) == pytest.approx(factor, rel=1e-12)
    explicit = tiny_hf_config("qwen3", rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                                        "original_max_position_embeddings": 32,
                                                        "attention_factor": 1.25})
    cfg = megatron_config.transformer_config(explicit, transformer_impl="local")
    assert _yarn_get_concentration_factor_from_config(cfg) == pytest.approx(1.25, rel=1e-12)
    assert (cfg.yarn_rotary_scaling_factor, cfg.yarn_original_max_position_embeddings) == (4.0, 32)
    assert (cfg.yarn_beta_fast, cfg.yarn_beta_slow) == (32.0, 1.0)
    # a legacy 4.x dict config with rope_scaling and top-level rope_theta
    legacy = {**tiny_hf_config("llama").to_dict(), "rope_parameters": None, "rope_theta": 5e5,
              "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
    assert registry.megatron_shape(legacy).rope_scaling.kind == "llama3"


def test_virtual_pipeline_needs_divisible_layers():
    with pytest.raises(UnsupportedModelError, match="num_hidden_layers"):
        megatron_config.transformer_config(tiny_hf_config("qwen3", num_hidden_layers=6), ParallelLayout(pp=2, vpp=2),
                                           transformer_impl="local")
    cfg = megatron_config.transformer_config(tiny_hf_config("qwen3"), ParallelLayout(pp=2, vpp=2),
                                             transformer_impl="local")
    assert cfg.virtual_pipeline_model_parallel_size == 2
