"""A supported Hugging Face decoder (:func:`~mcpo_megatron.models.registry.megatron_shape`) as megatron-core builds
it: the ``TransformerConfig``, the layer spec and the ``GPTModel`` arguments.

Everything the supported families share (RMSNorm, SwiGLU MLP, rotary embeddings that rotate halves, no linear
biases but Qwen2's q/k/v ones, no dropout) is set once in :func:`transformer_config`; what differs comes from the
shape's :class:`~mcpo_megatron.models.registry.ArchSpec` row.

Mixture of experts (Qwen3-MoE): HF's router is softmax over the experts, top-k,
then (``norm_topk_prob``) division by the sum of the k kept probabilities.
megatron's top-k router reproduces it exactly: with ``moe_router_pre_softmax=False``
it takes the top-k logits and a softmax over those k (= the renormalised
probabilities); with ``norm_topk_prob=False`` it takes the softmax over all
experts first (``moe_router_pre_softmax=True``).  Tokens travel with
megatron's all-to-all dispatcher (dropless: no capacity factor), which runs on
gloo.  megatron's load-balancing loss stays off: the policy's own
(:mod:`~mcpo_megatron.models.moe_balance`) reports the load and, when asked, optimises it.

YaRN's attention factor (transformers multiplies cos and sin by it) is applied by megatron's attention from
``yarn_mscale`` / ``yarn_mscale_all_dim``, which :func:`transformer_config` sets so that their ratio is
transformers' factor.

Hybrid decoders (Qwen3.5): ``experimental_attention_variant="gated_delta_net"`` with ``linear_attention_freq`` the
per-layer list (1: Gated DeltaNet, 0: full attention), ``attention_output_gate`` and
``layernorm_zero_centered_gamma``.  megatron's own hybrid block spec
(``get_transformer_block_with_experimental_attention_variant_spec``) takes the Transformer Engine backend only
(megatron-core 0.16.1 ``megatron/core/models/gpt/experimental_attention_variant_module_specs.py:356``: ``_get_backend_spec_provider``
asserts ``transformer_impl == "transformer_engine"``); the local spec here builds the same layers from local
modules: the GDN's ``in_proj`` a ``ColumnParallelLinear`` after a separate input norm (TE fuses that norm into
``in_proj`` as ``layer_norm_weight``), every norm :class:`~mcpo_megatron.models.local_norm.LocalRMSNorm`
(zero-centered) but the GDN's gated ``out_norm``, which HF's ``Qwen3_5RMSNormGated`` keeps plain
(``weight * x_hat``): :class:`~mcpo_megatron.models.local_norm.PlainLocalRMSNorm`.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from typing import Any

import torch

from mcpo_megatron.models.registry import MegatronShape, RopeScaling, arch_for, megatron_shape, unsupported


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


@dataclass(frozen=True)
class ParallelLayout:
    """The sizes a model is split over.

    tp, pp: tensor- and pipeline-parallel sizes. ep: the expert-parallel size of MoE layers. vpp: the virtual
    pipeline size (interleaved 1F1B; None or 1: none). cp: the context-parallel size (Transformer Engine's
    attention exchanges keys and values over the CP group point to point; the local spec's reference attention
    gathers them). sequence_parallel: megatron's sequence parallelism over the TP group (needs tp > 1).
    """

    tp: int = 1
    pp: int = 1
    ep: int = 1
    vpp: int | None = None
    cp: int = 1
    sequence_parallel: bool = False

    def __post_init__(self):
        if self.vpp is not None:
            object.__setattr__(self, "vpp", None if self.vpp == 1 else int(self.vpp))

    @classmethod
    def from_parallel_state(cls, *, sequence_parallel: bool = False) -> "ParallelLayout":
        """The sizes of megatron's initialised ``parallel_state`` (``init_distributed``)."""
        from megatron.core import parallel_state as ps

        return cls(tp=ps.get_tensor_model_parallel_world_size(), pp=ps.get_pipeline_model_parallel_world_size(),
                   ep=ps.get_expert_model_parallel_world_size(),
                   vpp=ps.get_virtual_pipeline_model_parallel_world_size(),
                   cp=ps.get_context_parallel_world_size(), sequence_parallel=sequence_parallel)


def transformer_config(
    hf_config: Any,
    layout: ParallelLayout = ParallelLayout(),
    *,
    dtype: torch.dtype = torch.float32,
    transformer_impl: str = "auto",
    **overrides: Any,
):
    """Build the megatron-core ``TransformerConfig`` equivalent to ``hf_config`` split over ``layout``.

    ``dtype`` is the parameter dtype (fp32 on CPU, bf16 on GPU). ``overrides`` are passed to
    ``TransformerConfig`` last (e.g. ``variable_seq_lengths``, ``recompute_granularity``,
    ``perform_initialization``).
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    shape = megatron_shape(hf_config, layout.tp, layout.ep)
    _check_layout(shape, layout, dtype)
    impl = resolve_impl(transformer_impl)
    kwargs: dict[str, Any] = {**_model_fields(shape), **_layout_fields(layout, dtype)}
    if layout.cp > 1:
        kwargs.update(context_parallel_size=layout.cp, cp_comm_type="p2p")
    if shape.is_moe:
        kwargs.update(_expert_fields(shape, ep=layout.ep, tp=layout.tp, grouped_gemm=impl == "transformer_engine"))
    if shape.is_hybrid:
        kwargs.update(_hybrid_fields(shape))
    if impl == "local":
        from megatron.core.transformer.enums import AttnBackend

        kwargs["attention_backend"] = AttnBackend.local
    kwargs.update(overrides)
    config = TransformerConfig(**kwargs)
    if shape.rope_scaling is not None and shape.rope_scaling.kind == "yarn":
        _set_yarn_fields(config, shape.rope_scaling)
    return config


def _check_layout(shape: MegatronShape, layout: ParallelLayout, dtype: torch.dtype) -> None:
    """The layout's rules that megatron would otherwise report later, or not at all."""
    pp, vpp, tp, sequence_parallel = layout.pp, layout.vpp, layout.tp, layout.sequence_parallel
    if shape.num_layers % (pp * (vpp or 1)) != 0:
        what = f"pipeline-parallel size {pp}" + (f" x virtual pipeline size {vpp}" if vpp else "")
        raise unsupported("num_hidden_layers", shape.num_layers, f"must be divisible by the {what}")
    if vpp and pp < 2:
        raise ValueError(f"virtual pipeline size {vpp} needs a pipeline-parallel size > 1 (got {pp})")
    if sequence_parallel and tp < 2:
        raise ValueError("sequence parallelism needs a tensor-parallel size > 1")
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"model dtype {dtype} must be float32, bfloat16 or float16")


def _model_fields(shape: MegatronShape) -> dict[str, Any]:
    """The decoder's sizes and the families' shared architecture."""
    return dict(
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
    )


def _hybrid_fields(shape: MegatronShape) -> dict[str, Any]:
    """A hybrid decoder's layer pattern, Gated DeltaNet sizes, gated attention and zero-centered norms."""
    gdn = shape.gdn
    return dict(
        experimental_attention_variant="gated_delta_net",
        linear_attention_freq=[int(shape.is_linear_attention(i)) for i in range(shape.num_layers)],
        linear_conv_kernel_dim=gdn.conv_kernel,
        linear_key_head_dim=gdn.key_head_dim,
        linear_value_head_dim=gdn.value_head_dim,
        linear_num_key_heads=gdn.num_key_heads,
        linear_num_value_heads=gdn.num_value_heads,
        attention_output_gate=True,
        layernorm_zero_centered_gamma=True,
    )


def _layout_fields(layout: ParallelLayout, dtype: torch.dtype) -> dict[str, Any]:
    """The parallel layout and the parameter dtype."""
    return dict(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        pipeline_dtype=dtype,
        sequence_parallel=bool(layout.sequence_parallel),
        use_cpu_initialization=not torch.cuda.is_available(),
    )


def _expert_fields(shape: MegatronShape, *, ep: int, tp: int, grouped_gemm: bool) -> dict[str, Any]:
    """A mixture-of-experts layer's router and experts (module docstring)."""
    return dict(
        num_moe_experts=shape.num_experts,
        moe_router_topk=shape.moe_topk,
        moe_ffn_hidden_size=shape.moe_ffn_hidden_size,
        moe_router_score_function="softmax",
        # top-k of the logits, softmax over the k = softmax, top-k, renormalise (norm_topk_prob)
        moe_router_pre_softmax=not shape.norm_topk_prob,
        moe_router_load_balancing_type="none",  # the load-balancing loss is moe_balance's
        moe_token_dispatcher_type="alltoall",  # variable sequence lengths; runs on gloo
        moe_grouped_gemm=grouped_gemm,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=tp,
    )


def _set_yarn_fields(config, r: RopeScaling) -> None:
    """YaRN's settings on ``config``: GPTModel(position_embedding_type="yarn") reads these (MLA's config fields)
    with getattr."""
    config.yarn_rotary_scaling_factor = r.factor
    config.yarn_original_max_position_embeddings = r.original_max_position_embeddings
    config.yarn_beta_fast = r.beta_fast
    config.yarn_beta_slow = r.beta_slow
    # megatron's attention multiplies cos and sin by (0.1 m ln s + 1) / (0.1 m_all ln s + 1); with
    # m_all = 0 and this m that is exactly transformers' attention factor.
    config.yarn_mscale = (r.attention_factor - 1.0) / (0.1 * math.log(r.factor)) if r.factor > 1 else 0.0
    config.yarn_mscale_all_dim = 0.0
    config.yarn_correction_range_round_to_int = r.truncate


def layer_spec(hf_config: Any, *, transformer_impl: str = "auto"):
    """The GPT layer ``ModuleSpec``: Transformer Engine spec on GPUs with TE, the local spec otherwise.

    MoE models get megatron's MoE layer: grouped-GEMM experts (``TEGroupedMLP``) with
    TE, one MLP per expert (``SequentialMLP``) on the local spec.  The local spec's
    norms are :class:`~mcpo_megatron.models.local_norm.LocalRMSNorm` (megatron's
    ``WrappedTorchNorm`` refuses sequence parallelism, which MoE with TP > 1 needs), and its core attention
    is :class:`~mcpo_megatron.parallel.cpu_attention.ReferenceDotProductAttention` (megatron's local one
    refuses packed sequences and context parallelism; TE's attention does both on GPUs).
    """
    from megatron.core.models.gpt import gpt_layer_specs

    arch = arch_for(hf_config)
    experts = megatron_shape(hf_config).num_experts or None
    if resolve_impl(transformer_impl) == "transformer_engine":
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=experts, moe_grouped_gemm=experts is not None, qk_layernorm=arch.qk_norm)
    spec = gpt_layer_specs.get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False,
                                                    qk_layernorm=arch.qk_norm, normalization="RMSNorm")
    return _with_reference_attention(_with_local_norms(spec))


def _with_reference_attention(spec):
    from mcpo_megatron.parallel.cpu_attention import ReferenceDotProductAttention

    spec.submodules.self_attention.submodules.core_attention = ReferenceDotProductAttention
    return spec


def _gdn_layer_spec(dense_spec):
    """A Gated DeltaNet layer on the local spec: the dense layer's norms, MLP and residuals around megatron's
    ``GatedDeltaNet`` (local linears, a plain gated out_norm)."""
    import copy

    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec

    from mcpo_megatron.models.local_norm import PlainLocalRMSNorm

    spec = copy.deepcopy(dense_spec)
    spec.submodules.self_attention = ModuleSpec(
        module=GatedDeltaNet,
        submodules=GatedDeltaNetSubmodules(in_proj=ColumnParallelLinear, out_norm=PlainLocalRMSNorm,
                                           out_proj=RowParallelLinear))
    return spec


def _hybrid_block_spec(hf_config: Any, config, dense_spec, vp_stage: int | None):
    """This stage's layers of a hybrid decoder, each chosen by its global index (``layer_types``)."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from mcpo_megatron.models.local_norm import LocalRMSNorm

    shape = megatron_shape(hf_config)
    gdn_spec = _gdn_layer_spec(dense_spec)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    layers = range(offset, offset + get_num_layers_to_build(config, vp_stage=vp_stage))
    return TransformerBlockSubmodules(
        layer_specs=[gdn_spec if shape.is_linear_attention(i) else dense_spec for i in layers],
        layer_norm=LocalRMSNorm)


def _with_local_norms(spec):
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from mcpo_megatron.models.local_norm import LocalRMSNorm

    sub = spec.submodules
    for name in ("input_layernorm", "pre_mlp_layernorm"):
        if getattr(sub, name) is WrappedTorchNorm:
            setattr(sub, name, LocalRMSNorm)
    attn = sub.self_attention.submodules
    for name in ("q_layernorm", "k_layernorm"):
        if getattr(attn, name) is WrappedTorchNorm:
            setattr(attn, name, LocalRMSNorm)
    return spec


def block_spec(hf_config: Any, config, *, transformer_impl: str = "auto", vp_stage: int | None = None):
    """What ``GPTModel`` gets as ``transformer_layer_spec`` for this (virtual) pipeline stage.

    The TE layer spec as is; on the local spec, a block spec whose final norm is
    :class:`~mcpo_megatron.models.local_norm.LocalRMSNorm` too (a hybrid decoder's: each layer by its global
    index).
    """
    if resolve_impl(transformer_impl) == "transformer_engine" and arch_for(hf_config).hybrid:
        raise unsupported("model_type", arch_for(hf_config).model_type,
                          "hybrid decoders build on the local layer spec only for now (megatron's TE hybrid spec "
                          "fuses the GDN's input norm and zero-centers its out_norm, which the weight mapping does "
                          "not cover yet); set model.transformer_impl=local")
    spec = layer_spec(hf_config, transformer_impl=transformer_impl)
    if resolve_impl(transformer_impl) == "transformer_engine":
        return spec
    if arch_for(hf_config).hybrid:
        return _hybrid_block_spec(hf_config, config, spec, vp_stage)
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    from mcpo_megatron.models.local_norm import LocalRMSNorm

    n = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[spec] * n, layer_norm=LocalRMSNorm)


def gpt_model_kwargs(hf_config: Any) -> dict[str, Any]:
    """``GPTModel`` constructor arguments that come from the HF config (vocab, rope, tying)."""
    shape = megatron_shape(hf_config)
    kwargs = dict(
        vocab_size=shape.vocab_size,
        max_sequence_length=shape.max_position_embeddings,
        position_embedding_type="rope",
        rotary_percent=shape.rotary_percent,
        rotary_base=shape.rope_theta,
        share_embeddings_and_output_weights=shape.tie_word_embeddings,
    )
    scaling = shape.rope_scaling
    if scaling is not None and scaling.kind == "llama3":
        kwargs.update(rope_scaling=True, rope_scaling_factor=scaling.factor)
    elif scaling is not None and scaling.kind == "yarn":
        kwargs["position_embedding_type"] = "yarn"
    return kwargs
