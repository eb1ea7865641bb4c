"""Hugging Face config -> the validated :class:`MegatronShape` megatron builds, one table entry per architecture
(a shape's ``TransformerConfig``, layer spec and ``GPTModel`` arguments: :mod:`~mcpo_megatron.models.megatron_config`).

Supported: Qwen3 (per-head q/k RMSNorm), Qwen3-MoE (Qwen3 attention, every MLP a
top-k routed mixture of SwiGLU experts), Qwen2 (q/k/v bias), Llama (including
tied embeddings, as in SmolLM2), and the Qwen3.5 dense language model
(``Qwen3_5ForCausalLM``, a hybrid decoder: see below).  Everything these families share (RMSNorm,
SwiGLU MLP, rotary embeddings, no linear biases otherwise) is encoded once; what
differs is the small :class:`ArchSpec` row.

Rotary scaling: Llama 3.x (``rope_type`` "llama3") maps to megatron's
``rope_scaling`` (its smoothing constants are fixed to Llama 3.1's: low/high
frequency factors 1 and 4 over 8192 original positions; other values are
refused) and YaRN ("yarn", Qwen's long-context setting) to megatron's
``YarnRotaryEmbedding``, with transformers' attention factor (its cos and sin multiplier).

Mixture of experts (Qwen3-MoE): a softmax router over the experts, top-k, with or without
``norm_topk_prob`` (megatron's router reproduces both).  Experts are SwiGLU MLPs of
width ``moe_intermediate_size``, split over expert-parallel ranks (EP) and, inside
each expert, over tensor-parallel ranks (expert-TP = TP).

Qwen3.5 (``model_type`` "qwen3_5_text"): ``layer_types`` names each layer "linear_attention" (megatron's
``GatedDeltaNet``, heads from the ``linear_*`` fields) or "full_attention" (Qwen3 attention with a sigmoid output
gate, megatron's ``attention_output_gate``, rotating the first ``partial_rotary_factor`` of each head: megatron's
``rotary_percent``); every norm of the decoder multiplies by ``1 + weight`` (megatron's
``layernorm_zero_centered_gamma``).  Its rope is multimodal (``mrope_section``): for text, the three position
rows are equal, and the sections then recompose exactly the plain rotary frequencies, which is what megatron
applies.  TP splits the GDN's key and value heads, so both counts must be divisible by TP.  A
``Qwen3_5ForConditionalGeneration`` checkpoint (the form Qwen3.5 ships in) gives its language model: see
:mod:`~mcpo_megatron.models.multimodal`.

Anything the mapping does not reproduce exactly (sliding-window attention,
other MoE families or dense/sparse layer mixes, other rope scalings, extra
biases, other activations) is rejected with a :class:`UnsupportedModelError`
that names the config field, its value and what is supported, instead of
silently training a different model.

Attention heads on tensor parallelism: megatron splits whole query groups
(KV heads) over TP ranks, so ``num_key_value_heads`` must be divisible by TP.
When it is not (SmolLM2-135M: 9 heads in 3 groups, at TP=2) we *pad* the query
groups up to the next multiple of TP with all-zero groups: zero q/k/v rows and
zero ``o_proj`` columns add exactly 0 to the attention output, receive exactly
zero gradients (the padded attention output is 0 and its ``o_proj`` columns are
0), and so stay zero under Adam/AdamW; export strips them.  See
:class:`MegatronShape`.

The vocabulary is never padded: ``vocab_size`` must be divisible by TP (true for
every supported checkpoint: 151936, 152064, 128256, 49152), so vocab-parallel
logits hold no padding columns that the log-prob code would have to mask.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

# The layer kinds of a hybrid decoder's layer_types (megatron's linear_attention_freq writes 1 and 0 for them).
from mcpo_megatron.config.shapes import FULL_ATTENTION, LINEAR_ATTENTION


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
    moe: bool = False  # every MLP is a routed mixture of experts (Qwen3-MoE)
    # Per-layer Gated DeltaNet / gated full attention from layer_types, zero-centered norms, partial rope (Qwen3.5)
    hybrid: bool = False


ARCHITECTURES: dict[str, ArchSpec] = {
    "qwen3": ArchSpec("qwen3", "qwen3", "Qwen3ForCausalLM", qkv_bias=False, qk_norm=True,
                      must_be_false=("attention_bias", "use_sliding_window")),
    "qwen3_moe": ArchSpec("qwen3_moe", "qwen3_moe", "Qwen3MoeForCausalLM", qkv_bias=False, qk_norm=True,
                          must_be_false=("attention_bias", "use_sliding_window"), moe=True),
    "qwen2": ArchSpec("qwen2", "qwen2", "Qwen2ForCausalLM", qkv_bias=True, qk_norm=False,
                      must_be_false=("use_sliding_window",)),
    "llama": ArchSpec("llama", "llama", "LlamaForCausalLM", qkv_bias=False, qk_norm=False,
                      must_be_false=("attention_bias", "mlp_bias")),
    "qwen3_5_text": ArchSpec("qwen3_5", "qwen3_5_text", "Qwen3_5ForCausalLM", qkv_bias=False, qk_norm=True,
                             must_be_false=("attention_bias",), hybrid=True),
}


# Fields that would mean mixture-of-experts if set to a positive number (rejected for dense families).
_MOE_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")

# Llama 3.x rope-scaling constants megatron-core hard-codes (RotaryEmbedding._apply_scaling, 0.16.1 to 0.19).
_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    if isinstance(cfg, dict):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def unsupported(field: str, value: Any, rule: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"unsupported model config: {field}={value!r}; {rule}. "
        f"Supported architectures: {', '.join(a.hf_architecture for a in ARCHITECTURES.values())} "
        "with full causal attention, SwiGLU (silu) MLPs and rope (unscaled, llama3 or yarn)."
    )


def arch_for(hf_config: Any) -> ArchSpec:
    """The :class:`ArchSpec` for a transformers config (object or dict); raises on unknown types."""
    model_type = _get(hf_config, "model_type")
    arch = ARCHITECTURES.get(model_type)
    if arch is None:
        raise unsupported("model_type", model_type,
                           f"model_type must be one of {sorted(ARCHITECTURES)}")
    archs = _get(hf_config, "architectures") or []
    for name in archs:
        if name != arch.hf_architecture:
            raise unsupported("architectures", archs,
                               f"model_type {model_type!r} needs architectures [{arch.hf_architecture!r}]")
    return arch


@dataclass(frozen=True)
class RopeScaling:
    """A rotary scaling megatron-core reproduces exactly.

    ``kind`` "llama3": inverse frequencies smoothed between wavelengths 8192/4 and 8192
    and divided by ``factor`` beyond (megatron ``rope_scaling``).  ``kind`` "yarn":
    NTK-by-parts interpolation between ``beta_fast`` and ``beta_slow`` rotations over
    ``original_max_position_embeddings`` (``truncate``: integer correction range) and
    cos/sin multiplied by ``attention_factor``.
    """

    kind: str
    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0
    truncate: bool = True


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_settings(hf_config: Any, *, partial_rotary: bool = False) -> tuple[float, RopeScaling | None]:
    """(rotary base, scaling) from transformers 5.x ``rope_parameters`` or 4.x ``rope_theta``/``rope_scaling``.

    Plain rope ("default"), "llama3" (with Llama 3.1's fixed smoothing constants) and
    "yarn" are supported; any other scaling type (linear, dynamic, longrope...) or
    unsupported parameter is rejected naming the field.  ``partial_rotary``: the family rotates only part of each
    head (:func:`rotary_fraction` reads it); otherwise a ``partial_rotary_factor`` other than 1 is refused.
    """
    params = _get(hf_config, "rope_parameters")
    field = "rope_parameters"
    if params is None:
        params = _get(hf_config, "rope_scaling")
        field = "rope_scaling"
    theta = _get(hf_config, "rope_theta")
    scaling = None
    if params:
        rope_type = params.get("rope_type", params.get("type", "default"))
        theta = params.get("rope_theta", theta)
        partial = params.get("partial_rotary_factor", 1.0)
        if partial not in (None, 1.0) and not partial_rotary:
            raise unsupported(f"{field}.partial_rotary_factor", partial, "must be 1.0")
        if rope_type == "llama3":
            for key, fixed in _LLAMA3_FIXED.items():
                if params.get(key) is not None and float(params[key]) != fixed:
                    raise unsupported(f"{field}.{key}", params[key],
                                       f"megatron-core's llama3 rope scaling fixes it to {fixed:g} (Llama 3.1); "
                                       "other values are not reproduced")
            scaling = RopeScaling("llama3", float(params["factor"]),
                                  int(_LLAMA3_FIXED["original_max_position_embeddings"]))
        elif rope_type == "yarn":
            original = params.get("original_max_position_embeddings") or _get(hf_config, "max_position_embeddings")
            factor = params.get("factor")
            if factor is None:
                factor = float(_get(hf_config, "max_position_embeddings")) / float(original)
            attention_factor = params.get("attention_factor")
            if attention_factor is None:
                mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
                attention_factor = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
                                    if mscale and mscale_all else _yarn_mscale(factor))
            if float(factor) <= 1 and float(attention_factor) != 1.0:
                raise unsupported(f"{field}.attention_factor", attention_factor,
                                   "with factor <= 1 megatron's YaRN applies no attention factor; it must be 1")
            scaling = RopeScaling("yarn", float(factor), int(original),
                                  beta_fast=float(params.get("beta_fast") or 32.0),
                                  beta_slow=float(params.get("beta_slow") or 1.0),
                                  attention_factor=float(attention_factor),
                                  truncate=bool(params.get("truncate", True)))
        elif rope_type != "default":
            raise unsupported(f"{field}.rope_type", rope_type,
                               "supported: 'default' (unscaled), 'llama3' and 'yarn'")
    partial = _get(hf_config, "partial_rotary_factor", 1.0)
    if partial not in (None, 1.0) and not partial_rotary:
        raise unsupported("partial_rotary_factor", partial, "must be 1.0")
    if theta is None:
        theta = 10000.0
    return float(theta), scaling


def rotary_fraction(hf_config: Any) -> float:
    """The fraction of each head's dimensions that rope rotates (``partial_rotary_factor``; 1 when absent)."""
    params = _get(hf_config, "rope_parameters") or {}
    value = params.get("partial_rotary_factor", _get(hf_config, "partial_rotary_factor", 1.0))
    value = 1.0 if value is None else float(value)
    if not 0 < value <= 1:
        raise unsupported("partial_rotary_factor", value, "must be in (0, 1]")
    return value


@dataclass(frozen=True)
class GDNHeads:
    """A hybrid decoder's Gated DeltaNet sizes (HF ``linear_*`` fields), the same in every linear-attention layer."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int

    @property
    def qk_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def v_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim


@dataclass(frozen=True)
class MegatronShape:
    """The numbers of a supported HF decoder as megatron builds it at one TP and EP size: the TP padding of
    query groups and the experts per rank (the configured model's sizes without any layout are
    :class:`mcpo_megatron.config.shapes.ModelShape`).

    ``num_query_groups`` / ``num_attention_heads`` are the padded counts megatron
    is built with; ``hf_kv_heads`` / ``hf_heads`` the real ones.  Query head ``h``
    belongs to group ``h // heads_per_group`` in both layouts; padded groups are
    appended after the real ones.

    Mixture of experts (``num_experts > 0``): ``moe_topk`` experts of width
    ``moe_ffn_hidden_size`` per token, ``ep`` expert-parallel ranks holding
    ``num_local_experts`` consecutive experts each (expert-TP = ``tp``).
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
    rope_scaling: RopeScaling | None = None
    num_experts: int = 0
    moe_topk: int = 0
    moe_ffn_hidden_size: int = 0
    norm_topk_prob: bool = True
    ep: int = 1
    # Hybrid decoders (ArchSpec.hybrid): each layer's kind, the GDN sizes, the rotated fraction of a head.
    layer_types: tuple[str, ...] = ()
    gdn: GDNHeads | None = None
    rotary_percent: float = 1.0

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_hybrid(self) -> bool:
        return self.arch.hybrid

    def is_linear_attention(self, layer: int) -> bool:
        """Whether global layer ``layer`` is a Gated DeltaNet layer."""
        return bool(self.layer_types) and self.layer_types[layer] == LINEAR_ATTENTION

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.ep

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


def _moe_fields(hf_config: Any, arch: ArchSpec, tp: int, ep: int) -> dict[str, Any]:
    """Validated expert settings of a Qwen3-MoE config (empty for dense families, which must have none)."""
    if not isinstance(ep, int) or ep < 1:
        raise ValueError(f"expert-parallel size ep={ep!r} must be a positive integer")
    if not arch.moe:
        for field in _MOE_FIELDS:
            value = _get(hf_config, field)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                raise unsupported(field, value, f"{arch.hf_architecture} has no experts; use a MoE architecture "
                                   "(Qwen3MoeForCausalLM)")
        if ep != 1:
            raise unsupported("num_experts", None, f"expert parallelism (ep={ep}) needs a mixture-of-experts model")
        return {}
    experts = _get(hf_config, "num_experts") or _get(hf_config, "num_local_experts")
    topk = _get(hf_config, "num_experts_per_tok")
    width = _get(hf_config, "moe_intermediate_size")
    for field, value in (("num_experts", experts), ("num_experts_per_tok", topk), ("moe_intermediate_size", width)):
        if not isinstance(value, int) or value < 1:
            raise unsupported(field, value, "must be a positive integer for a mixture-of-experts model")
    if topk > experts:
        raise unsupported("num_experts_per_tok", topk, f"must be <= num_experts={experts}")
    norm = bool(_get(hf_config, "norm_topk_prob", True))
    if topk == 1 and norm:
        raise unsupported("norm_topk_prob", True, "with num_experts_per_tok=1 every weight is 1; megatron's router "
                           "needs its softmax before the top-1 (set norm_topk_prob=false to match it)")
    step = _get(hf_config, "decoder_sparse_step", 1)
    if step not in (None, 1):
        raise unsupported("decoder_sparse_step", step, "every layer must be a MoE layer (1)")
    dense_layers = _get(hf_config, "mlp_only_layers") or []
    if dense_layers:
        raise unsupported("mlp_only_layers", list(dense_layers), "every layer must be a MoE layer (empty list)")
    if _get(hf_config, "shared_expert_intermediate_size"):
        raise unsupported("shared_expert_intermediate_size", _get(hf_config, "shared_expert_intermediate_size"),
                           "shared experts are not supported")
    if experts % ep != 0:
        raise unsupported("num_experts", experts,
                           f"must be divisible by the expert-parallel size {ep}; choose an EP that divides it")
    if width % tp != 0:
        raise unsupported("moe_intermediate_size", width,
                           f"must be divisible by the tensor-parallel size {tp} (experts are split over TP too)")
    return dict(num_experts=int(experts), moe_topk=int(topk), moe_ffn_hidden_size=int(width),
                norm_topk_prob=norm, ep=ep)


def _hybrid_fields(hf_config: Any, num_layers: int, tp: int) -> dict[str, Any]:
    """Validated layer pattern and Gated DeltaNet sizes of a hybrid decoder (Qwen3.5)."""
    layer_types = tuple(_get(hf_config, "layer_types") or ())
    if len(layer_types) != num_layers:
        raise unsupported("layer_types", list(layer_types), f"must name each of the {num_layers} layers")
    bad = sorted({t for t in layer_types if t not in (LINEAR_ATTENTION, FULL_ATTENTION)})
    if bad:
        raise unsupported("layer_types", bad, f"each layer must be {LINEAR_ATTENTION!r} or {FULL_ATTENTION!r}")
    sizes = {}
    for field in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                  "linear_conv_kernel_dim"):
        value = _get(hf_config, field)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise unsupported(field, value, "must be a positive integer for a Gated DeltaNet layer")
        sizes[field] = value
    gdn = GDNHeads(sizes["linear_num_key_heads"], sizes["linear_num_value_heads"], sizes["linear_key_head_dim"],
                   sizes["linear_value_head_dim"], sizes["linear_conv_kernel_dim"])
    if gdn.num_value_heads % gdn.num_key_heads:
        raise unsupported("linear_num_value_heads", gdn.num_value_heads,
                          f"must be a multiple of linear_num_key_heads={gdn.num_key_heads} (megatron repeats each "
                          "key head over a whole number of value heads)")
    for field, value in (("linear_num_key_heads", gdn.num_key_heads), ("linear_num_value_heads", gdn.num_value_heads)):
        if value % tp:
            raise unsupported(field, value, f"must be divisible by the tensor-parallel size {tp} (megatron splits "
                              "the Gated DeltaNet heads over TP, with no padding); choose a TP that divides it")
    return dict(layer_types=layer_types, gdn=gdn, rotary_percent=rotary_fraction(hf_config))


def megatron_shape(hf_config: Any, tp: int = 1, ep: int = 1) -> MegatronShape:
    """Validate ``hf_config`` for our mapping and return its :class:`MegatronShape` at TP ``tp`` and EP ``ep``."""
    arch = arch_for(hf_config)
    for field in arch.must_be_false:
        value = _get(hf_config, field)
        if value:
            raise unsupported(field, value, f"{arch.hf_architecture} is supported only with {field}=False")
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tensor-parallel size tp={tp!r} must be a positive integer")
    moe = _moe_fields(hf_config, arch, tp, ep)
    layer_types = _get(hf_config, "layer_types")
    hybrid = _hybrid_fields(hf_config, int(_get(hf_config, "num_hidden_layers")), tp) if arch.hybrid else {}
    if layer_types and not arch.hybrid and any(t != "full_attention" for t in layer_types):
        bad = sorted({t for t in layer_types if t != "full_attention"})
        raise unsupported("layer_types", bad, "every layer must be 'full_attention' (no sliding window)")
    act = _get(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise unsupported("hidden_act", act, "only 'silu' (SwiGLU) MLPs are supported")
    theta, scaling = rope_settings(hf_config, partial_rotary=arch.hybrid)

    heads = int(_get(hf_config, "num_attention_heads"))
    kv = _get(hf_config, "num_key_value_heads") or heads
    kv = int(kv)
    if heads % kv != 0:
        raise unsupported("num_key_value_heads", kv,
                           f"num_attention_heads={heads} must be a multiple of it")
    hidden = int(_get(hf_config, "hidden_size"))
    head_dim = _get(hf_config, "head_dim") or hidden // heads
    vocab = int(_get(hf_config, "vocab_size"))
    if vocab % tp != 0:
        raise unsupported("vocab_size", vocab,
                           f"must be divisible by the tensor-parallel size {tp}; choose a TP that divides it")
    ffn = int(_get(hf_config, "intermediate_size"))
    if ffn % tp != 0 and not moe:  # a MoE model has no dense MLP (intermediate_size is unused)
        raise unsupported("intermediate_size", ffn,
                           f"must be divisible by the tensor-parallel size {tp}; choose a TP that divides it")
    return MegatronShape(
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
        rope_scaling=scaling,
        **moe,
        **hybrid,
    )


def describe(shape: MegatronShape) -> dict[str, Any]:
    """A JSON-friendly summary (for logs and reports)."""
    d = dataclasses.asdict(shape)
    d["arch"] = shape.arch.name
    d["rope_scaling"] = dataclasses.asdict(shape.rope_scaling) if shape.rope_scaling else None
    d["gdn"] = dataclasses.asdict(shape.gdn) if shape.gdn else None
    d.update(num_query_groups=shape.num_query_groups, num_attention_heads=shape.num_attention_heads)
    return d
