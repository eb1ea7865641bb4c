"""Hugging Face config -> megatron-core ``TransformerConfig`` + layer spec, one table entry per architecture.

Supported: Qwen3 (per-head q/k RMSNorm), Qwen2 (q/k/v bias), Llama (including
tied embeddings, as in SmolLM2).  Everything these families share (RMSNorm,
SwiGLU MLP, rotary embeddings without scaling, no linear biases otherwise) is
encoded once; what differs is the small :class:`ArchSpec` row.

Anything the mapping does not reproduce exactly (sliding-window attention,
mixture of experts, rope scaling, extra biases, other activations) is rejected
with a :class:`UnsupportedModelError` that names the config field, its value
and what is supported, instead of silently training a different model.

Attention heads on tensor parallelism: megatron splits whole query groups
(KV heads) over TP ranks, so ``num_key_value_heads`` must be divisible by TP.
When it is not (SmolLM2-135M: 9 heads in 3 groups, at TP=2) we *pad* the query
groups up to the next multiple of TP with all-zero groups: zero q/k/v rows and
zero ``o_proj`` columns add exactly 0 to the attention output, receive exactly
zero gradients (the padded attention output is 0 and its ``o_proj`` columns are
0), and so stay zero under Adam/AdamW; export strips them.  See
:class:`ModelShape`.

The vocabulary is never padded: ``vocab_size`` must be divisible by TP (true for
every supported checkpoint: 151936, 152064, 128256, 49152), so vocab-parallel
logits hold no padding columns that the log-prob code would have to mask.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass
from typing import Any

import torch


class UnsupportedModelError(ValueError):
    """The Hugging Face config asks for something this mapping does not implement."""


@dataclass(frozen=True)
class ArchSpec:
    """What differs between the supported decoder families (one row of :data:`ARCHITECTURES`)."""

    name: str
    model_type: str
    hf_architecture: str
    qkv_bias: bool  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool  # per-head RMSNorm on queries and keys before rope (Qwen3)
    # Config fields that must be falsy for this family (attention_bias, mlp_bias...):
    must_be_false: tuple[str, ...] = ()


ARCHITECTURES: dict[str, ArchSpec] = {
    "qwen3": ArchSpec("qwen3", "qwen3", "Qwen3ForCausalLM", qkv_bias=False, qk_norm=True,
                      must_be_false=("attention_bias", "use_sliding_window")),
    "qwen2": ArchSpec("qwen2", "qwen2", "Qwen2ForCausalLM", qkv_bias=True, qk_norm=False,
                      must_be_false=("use_sliding_window",)),
    "llama": ArchSpec("llama", "llama", "LlamaForCausalLM", qkv_bias=False, qk_norm=False,
                      must_be_false=("attention_bias", "mlp_bias")),
}

# Fields that would mean mixture-of-experts if set to a positive number.
_MOE_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    if isinstance(cfg, dict):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def _unsupported(field: str, value: Any, rule: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"unsupported model config: {field}={value!r}; {rule}. "
        f"Supported architectures: {', '.join(a.hf_architecture for a in ARCHITECTURES.values())} "
        "with full causal attention, SwiGLU (silu) MLP and unscaled rope."
    )


def arch_for(hf_config: Any) -> ArchSpec:
    """The :class:`ArchSpec` for a transformers config (object or dict); raises on unknown types."""
    model_type = _get(hf_config, "model_type")
    arch = ARCHITECTURES.get(model_type)
    if arch is None:
        raise _unsupported("model_type", model_type,
                           f"model_type must be one of {sorted(ARCHITECTURES)}")
    archs = _get(hf_config, "architectures") or []
    for name in archs:
        if name != arch.hf_architecture:
            raise _unsupported("architectures", archs,
                               f"model_type {model_type!r} needs architectures [{arch.hf_architecture!r}]")
    return arch


def rope_theta(hf_config: Any) -> float:
    """Rotary base; accepts transformers 5.x ``rope_parameters`` and 4.x ``rope_theta``/``rope_scaling``.

    Only plain rope (``rope_type`` "default") is supported: any scaling type
    (linear, dynamic, yarn, llama3, longrope) is rejected naming the field.
    """
    params = _get(hf_config, "rope_parameters")
    field = "rope_parameters"
    if params is None:
        params = _get(hf_config, "rope_scaling")
        field = "rope_scaling"
    theta = _get(hf_config, "rope_theta")
    if params:
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type != "default":
            raise _unsupported(f"{field}.rope_type", rope_type,
                               "only unscaled rope ('default') is supported")
        theta = params.get("rope_theta", theta)
        partial = params.get("partial_rotary_factor", 1.0)
        if partial not in (None, 1.0):
            raise _unsupported(f"{field}.partial_rotary_factor", partial, "must be 1.0")
    partial = _get(hf_config, "partial_rotary_factor", 1.0)
    if partial not in (None, 1.0):
        raise _unsupported("partial_rotary_factor", partial, "must be 1.0")
    if theta is None:
        theta = 10000.0
    return float(theta)


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a supported HF decoder, plus the TP padding of query groups.

    ``num_query_groups`` / ``num_attention_heads`` are the padded counts megatron
    is built with; ``hf_kv_heads`` / ``hf_heads`` the real ones.  Query head ``h``
    belongs to group ``h // heads_per_group`` in both layouts; padded groups are
    appended after the real ones.
    """

    arch: ArchSpec
    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    hf_heads: int
    hf_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    initializer_range: float
    tp: int = 1

    @property
    def heads_per_group(self) -> int:
        return self.hf_heads // self.hf_kv_heads

    @property
    def num_query_groups(self) -> int:
        return -(-self.hf_kv_heads // self.tp) * self.tp

    @property
    def num_attention_heads(self) -> int:
        return self.num_query_groups * self.heads_per_group

    @property
    def padded_groups(self) -> int:
        return self.num_query_groups - self.hf_kv_heads


def model_shape(hf_config: Any, tp: int = 1) -> ModelShape:
    """Validate ``hf_config`` for our mapping and return its :class:`ModelShape` at tensor-parallel ``tp``."""
    arch = arch_for(hf_config)
    for field in arch.must_be_false:
        value = _get(hf_config, field)
        if value:
            raise _unsupported(field, value, f"{arch.hf_architecture} is supported only with {field}=False")
    for field in _MOE_FIELDS:
        value = _get(hf_config, field)
        if isinstance(value, int) and value > 0:
            raise _unsupported(field, value, "mixture-of-experts models are not supported")
    layer_types = _get(hf_config, "layer_types")
    if layer_types and any(t != "full_attention" for t in layer_types):
        bad = sorted({t for t in layer_types if t != "full_attention"})
        raise _unsupported("layer_types", bad, "every layer must be 'full_attention' (no sliding window)")
    act = _get(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise _unsupported("hidden_act", act, "only 'silu' (SwiGLU) MLPs are supported")
    theta = rope_theta(hf_config)

    heads = int(_get(hf_config, "num_attention_heads"))
    kv = _get(hf_config, "num_key_value_heads") or heads
    kv = int(kv)
    if heads % kv != 0:
        raise _unsupported("num_key_value_heads", kv,
                           f"num_attention_heads={heads} must be a multiple of it")
    hidden = int(_get(hf_config, "hidden_size"))
    head_dim = _get(hf_config, "head_dim") or hidden // heads
    vocab = int(_get(hf_config, "vocab_size"))
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tensor-parallel size tp={tp!r} must be a positive integer")
    if vocab % tp != 0:
        raise _unsupported("vocab_size", vocab,
                           f"must be divisible by the tensor-parallel size {tp}; choose a TP that divides it")
    ffn = int(_get(hf_config, "intermediate_size"))
    if ffn % tp != 0:
        raise _unsupported("intermediate_size", ffn,
                           f"must be divisible by the tensor-parallel size {tp}; choose a TP that divides it")
    return ModelShape(
        arch=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        ffn_hidden_size=ffn,
        num_layers=int(_get(hf_config, "num_hidden_layers")),
        hf_heads=heads,
        hf_kv_heads=kv,
        head_dim=int(head_dim),
        rms_norm_eps=float(_get(hf_config, "rms_norm_eps", 1e-6)),
        rope_theta=theta,
        max_position_embeddings=int(_get(hf_config, "max_position_embeddings", 4096)),
        tie_word_embeddings=bool(_get(hf_config, "tie_word_embeddings", False)),
        initializer_range=float(_get(hf_config, "initializer_range", 0.02)),
        tp=tp,
    )


def te_available() -> bool:
    """True when Transformer Engine can be used (importable and a GPU present); never imports it."""
    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


def resolve_impl(transformer_impl: str = "auto") -> str:
    """``"transformer_engine"`` or ``"local"`` from a config value ``auto|local|transformer_engine``."""
    if transformer_impl == "auto":
        return "transformer_engine" if te_available() else "local"
    if transformer_impl == "local":
        return "local"
    if transformer_impl == "transformer_engine":
        if not te_available():
            raise RuntimeError(
                "model.transformer_impl='transformer_engine' needs a GPU and the transformer_engine "
                "package; use 'local' (or 'auto') on CPU"
            )
        return "transformer_engine"
    raise ValueError(
        f"model.transformer_impl={transformer_impl!r} must be one of 'auto', 'local', 'transformer_engine'"
    )


def transformer_config(
    hf_config: Any,
    *,
    tp: int = 1,
    pp: int = 1,
    dtype: torch.dtype = torch.float32,
    transformer_impl: str = "auto",
    **overrides: Any,
):
    """Build the megatron-core ``TransformerConfig`` equivalent to ``hf_config`` at TP=``tp``, PP=``pp``.

    ``dtype`` is the parameter dtype (fp32 on CPU, bf16 on GPU).  ``overrides``
    are passed to ``TransformerConfig`` last (e.g. ``variable_seq_lengths``,
    ``recompute_granularity``, ``perform_initialization``).
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    shape = model_shape(hf_config, tp)
    if shape.num_layers % pp != 0:
        raise _unsupported("num_hidden_layers", shape.num_layers,
                           f"must be divisible by the pipeline-parallel size {pp}")
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"model dtype {dtype} must be float32, bfloat16 or float16")
    impl = resolve_impl(transformer_impl)
    on_gpu = torch.cuda.is_available()
    kwargs: dict[str, Any] = dict(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        ffn_hidden_size=shape.ffn_hidden_size,
        num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_query_groups,
        kv_channels=shape.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=shape.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=shape.arch.qkv_bias,
        qk_layernorm=shape.arch.qk_norm,
        rotary_interleaved=False,  # HF rotates halves (rotate_half), not interleaved pairs
        apply_rope_fusion=False,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        persist_layer_norm=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        init_method_std=shape.initializer_range,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        pipeline_dtype=dtype,
        sequence_parallel=False,
        use_cpu_initialization=not on_gpu,
    )
    if impl == "local":
        from megatron.core.transformer.enums import AttnBackend

        kwargs["attention_backend"] = AttnBackend.local
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def layer_spec(hf_config: Any, *, transformer_impl: str = "auto"):
    """The GPT layer ``ModuleSpec``: Transformer Engine spec on GPUs with TE, the local spec otherwise."""
    from megatron.core.models.gpt import gpt_layer_specs

    arch = arch_for(hf_config)
    if resolve_impl(transformer_impl) == "transformer_engine":
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=arch.qk_norm)
    return gpt_layer_specs.get_gpt_layer_local_spec(qk_layernorm=arch.qk_norm, normalization="RMSNorm")


def gpt_model_kwargs(hf_config: Any) -> dict[str, Any]:
    """``GPTModel`` constructor arguments that come from the HF config (vocab, rope, tying)."""
    shape = model_shape(hf_config)
    return dict(
        vocab_size=shape.vocab_size,
        max_sequence_length=shape.max_position_embeddings,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=shape.rope_theta,
        share_embeddings_and_output_weights=shape.tie_word_embeddings,
    )


def describe(shape: ModelShape) -> dict[str, Any]:
    """A JSON-friendly summary (for logs and reports)."""
    d = dataclasses.asdict(shape)
    d["arch"] = shape.arch.name
    d.update(num_query_groups=shape.num_query_groups, num_attention_heads=shape.num_attention_heads)
    return d
