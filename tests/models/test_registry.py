"""HF config -> TransformerConfig: the mapped fields, and errors that name the offending field."""

import pytest
import torch

from mcpo_megatron.models import registry
from mcpo_megatron.models.registry import UnsupportedModelError
from mcpo_megatron.models.sources import tiny_hf_config


def test_qwen3_config_fields():
    hf = tiny_hf_config("qwen3")
    cfg = registry.transformer_config(hf, tp=2, pp=2, transformer_impl="local")
    assert (cfg.num_layers, cfg.hidden_size, cfg.ffn_hidden_size) == (4, 64, 128)
    assert (cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels) == (4, 2, 16)
    assert cfg.normalization == "RMSNorm" and cfg.layernorm_epsilon == hf.rms_norm_eps
    assert cfg.gated_linear_unit and cfg.activation_func is torch.nn.functional.silu
    assert not cfg.add_bias_linear and not cfg.add_qkv_bias and cfg.qk_layernorm
    assert not cfg.rotary_interleaved and not cfg.apply_rope_fusion
    assert cfg.attention_dropout == 0.0 and cfg.hidden_dropout == 0.0
    assert (cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size) == (2, 2)
    assert cfg.params_dtype == torch.float32 and cfg.pipeline_dtype == torch.float32
    kw = registry.gpt_model_kwargs(hf)
    assert kw["rotary_base"] == 1000000.0 and kw["position_embedding_type"] == "rope"
    assert kw["share_embeddings_and_output_weights"] is False and kw["vocab_size"] == 256


def test_qwen2_bias_and_llama_tied():
    q2 = registry.transformer_config(tiny_hf_config("qwen2"), transformer_impl="local", dtype=torch.bfloat16)
    assert q2.add_qkv_bias and not q2.qk_layernorm and q2.bf16 and q2.params_dtype == torch.bfloat16
    assert q2.kv_channels == 16  # hidden / heads when head_dim is absent
    ll = tiny_hf_config("llama-tied")
    assert registry.gpt_model_kwargs(ll)["share_embeddings_and_output_weights"] is True
    assert not registry.transformer_config(ll, transformer_impl="local").qk_layernorm


def test_query_groups_padded_for_tp():
    hf = tiny_hf_config("llama-tied", num_attention_heads=9, num_key_value_heads=3, hidden_size=72, head_dim=8)
    cfg = registry.transformer_config(hf, tp=2, transformer_impl="local")
    assert (cfg.num_query_groups, cfg.num_attention_heads) == (4, 12)
    shape = registry.model_shape(hf, 2)
    assert (shape.hf_heads, shape.hf_kv_heads, shape.padded_groups) == (9, 3, 1)


def test_layer_spec_local_on_cpu():
    from megatron.core.transformer.identity_op import IdentityOp

    spec = registry.layer_spec(tiny_hf_config("qwen3"), transformer_impl="auto")
    attn = spec.submodules.self_attention.submodules
    assert attn.q_layernorm is not IdentityOp and attn.k_layernorm is not IdentityOp
    spec = registry.layer_spec(tiny_hf_config("llama"), transformer_impl="local")
    assert spec.submodules.self_attention.submodules.q_layernorm is IdentityOp
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="transformer_impl"):
            registry.layer_spec(tiny_hf_config("llama"), transformer_impl="transformer_engine")


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
                       rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}),
     "rope_parameters.rope_type"),
    (lambda: {**tiny_hf_config("llama").to_dict(), "rope_parameters": None,
              "rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling.rope_type"),
    (lambda: with_attr(tiny_hf_config("qwen3"), architectures=["Qwen3MoeForCausalLM"]), "architectures"),
])
def test_unsupported_configs_name_the_field(make, field):
    with pytest.raises(UnsupportedModelError, match=field.replace(".", r"\.")):
        registry.model_shape(make())


def test_tp_divisibility_errors_name_the_field():
    with pytest.raises(UnsupportedModelError, match="vocab_size"):
        registry.model_shape(tiny_hf_config("qwen3", vocab_size=255), 2)
    with pytest.raises(UnsupportedModelError, match="num_hidden_layers"):
        registry.transformer_config(tiny_hf_config("qwen3", num_hidden_layers=3), pp=2, transformer_impl="local")
