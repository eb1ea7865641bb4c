"""The model's shape for validation and planning, from ``model.arch``, the model's config.json, or a built-in
table of public shapes (for machines without the weights: login nodes, laptops)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from typing import Any, Optional

from omegaconf import OmegaConf

from mcpo_megatron.config.errors import ConfigError
from mcpo_megatron.config.loading import as_dictconfig

LINEAR_ATTENTION, FULL_ATTENTION = "linear_attention", "full_attention"
# What a hybrid decoder's Gated DeltaNet layers are sized by (HF config fields, model.arch keys alike).
_LINEAR_FIELDS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                  "linear_conv_kernel_dim")


@dataclass(frozen=True)
class ModelShape:
    """The configured model's sizes, read without loading it (validation, the planner, FLOP accounting); the
    layout megatron builds from them at a TP and EP size is :class:`mcpo_megatron.models.registry.MegatronShape`."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    ffn_hidden_size: int
    vocab_size: int
    head_dim: int
    max_position_embeddings: Optional[int]
    tie_word_embeddings: bool
    family: Optional[str]
    source: str                                    # "model.arch" | "<path>/config.json" | "builtin table"
    num_experts: int = 0                           # mixture of experts: routed experts (0: dense)
    num_experts_per_tok: int = 0
    moe_ffn_hidden_size: int = 0                   # width of one expert's SwiGLU MLP
    multimodal: bool = False                       # the LM sits under text_config (...ForConditionalGeneration)
    shared_expert_ffn_hidden_size: int = 0         # a MoE layer's gated shared expert (Qwen3.5-MoE, Qwen3-Next)
    # Hybrid decoders (Qwen3.5, Qwen3-Next): each layer's kind, "linear_attention" (Gated DeltaNet) or
    # "full_attention" (gated attention); empty for the other families, whose layers are all full attention.
    layer_types: tuple[str, ...] = ()
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    # Bytes of one value of a Gated DeltaNet layer's recurrent state in vLLM: the checkpoint's mamba_ssm_dtype
    # (fp32 in Qwen3.5's), which vLLM keeps for Qwen3.5 only, else the model's bf16 (docs/scaling.md).
    ssm_state_bytes: int = 2

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_hybrid(self) -> bool:
        return bool(self.layer_types)

    @property
    def num_linear_attention_layers(self) -> int:
        return sum(t == LINEAR_ATTENTION for t in self.layer_types)

    @property
    def num_full_attention_layers(self) -> int:
        return self.num_layers - self.num_linear_attention_layers


# The columns of a row of _PUBLIC_SHAPES; rows of dense models end after family.
_COLUMNS = ("num_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "ffn_hidden_size", "vocab_size",
            "head_dim", "max_position_embeddings", "tie_word_embeddings", "family",
            "num_experts", "num_experts_per_tok", "moe_ffn_hidden_size")

# Public architecture facts (the models' published config.json files), for machines without the weights.
_PUBLIC_SHAPES: dict[str, tuple] = {
    "qwen/qwen3-0.6b": (28, 1024, 16, 8, 3072, 151936, 128, 40960, True, "qwen3"),
    "qwen/qwen3-1.7b": (28, 2048, 16, 8, 6144, 151936, 128, 40960, True, "qwen3"),
    "qwen/qwen3-4b": (36, 2560, 32, 8, 9728, 151936, 128, 40960, True, "qwen3"),
    "qwen/qwen3-8b": (36, 4096, 32, 8, 12288, 151936, 128, 40960, False, "qwen3"),
    "qwen/qwen3-14b": (40, 5120, 40, 8, 17408, 151936, 128, 40960, False, "qwen3"),
    "qwen/qwen3-32b": (64, 5120, 64, 8, 25600, 151936, 128, 40960, False, "qwen3"),
    "qwen/qwen3-30b-a3b": (48, 2048, 32, 4, 6144, 151936, 128, 40960, False, "qwen3_moe", 128, 8, 768),
    "qwen/qwen3-30b-a3b-base": (48, 2048, 32, 4, 6144, 151936, 128, 32768, False, "qwen3_moe", 128, 8, 768),
    "qwen/qwen3-235b-a22b": (94, 4096, 64, 4, 12288, 151936, 128, 40960, False, "qwen3_moe", 128, 8, 1536),
    "huggingfacetb/smollm2-135m": (30, 576, 9, 3, 1536, 49152, 64, 8192, True, "llama"),
    "huggingfacetb/smollm2-135m-instruct": (30, 576, 9, 3, 1536, 49152, 64, 8192, True, "llama"),
    "builtin:smollm2-135m-instruct": (30, 576, 9, 3, 1536, 49152, 64, 8192, True, "llama"),
    # models/tiny.py (the character vocabulary: 100 tokens) on models.tiny.tiny_hf_config
    "builtin:tiny-qwen3": (4, 64, 4, 2, 128, 100, 16, 256, False, "qwen3"),
    "builtin:tiny-qwen3-moe": (4, 64, 4, 2, 128, 100, 16, 256, False, "qwen3_moe", 4, 2, 32),
    # models/tool_model.py (its phrase vocabulary: 512 tokens, as wide as the one-hot embedding)
    "builtin:tiny-tool-qwen3": (2, 512, 4, 2, 128, 512, 32, 1024, False, "qwen3"),
    "meta-llama/llama-3.1-8b": (32, 4096, 32, 8, 14336, 128256, 128, 131072, False, "llama"),
    "meta-llama/llama-3.1-8b-instruct": (32, 4096, 32, 8, 14336, 128256, 128, 131072, False, "llama"),
}
KNOWN_SHAPES: dict[str, dict] = {name: dict(zip(_COLUMNS, row)) for name, row in _PUBLIC_SHAPES.items()}


def _hybrid_row(dense: tuple, interval: int, linear: tuple, shared_expert: int = 0) -> dict:
    """A hybrid decoder's row: the dense columns, a full-attention layer every ``interval`` layers (the last of
    each group, as ``full_attention_interval`` places it), the Gated DeltaNet sizes (_LINEAR_FIELDS)."""
    row = dict(zip(_COLUMNS, dense))
    row.update(full_attention_interval=interval, shared_expert_ffn_hidden_size=shared_expert,
               **dict(zip(_LINEAR_FIELDS, linear)))
    return row


# Public hybrid shapes (their config.json files: the text_config of the ...ForConditionalGeneration checkpoints).
KNOWN_SHAPES.update({
    "qwen/qwen3.5-27b": _hybrid_row((64, 5120, 24, 4, 17408, 248320, 256, 262144, False, "qwen3_5_text"), 4,
                                    (16, 48, 128, 128, 4)),
    "qwen/qwen3.5-35b-a3b": _hybrid_row((40, 2048, 16, 2, 0, 248320, 256, 262144, False, "qwen3_5_moe_text",
                                         256, 8, 512), 4, (16, 32, 128, 128, 4), shared_expert=512),
    "qwen/qwen3-next-80b-a3b-instruct": _hybrid_row((48, 2048, 16, 2, 5120, 151936, 256, 262144, False, "qwen3_next",
                                                     512, 10, 512), 4, (16, 32, 128, 128, 4), shared_expert=512),
})
for _name in ("qwen/qwen3.5-27b", "qwen/qwen3.5-35b-a3b"):
    KNOWN_SHAPES[_name]["multimodal"] = True

_HF_FAMILY = {"Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe", "Qwen2ForCausalLM": "qwen2",
              "LlamaForCausalLM": "llama"}


def _complete(d: dict, source: str) -> ModelShape:
    required = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "vocab_size")
    missing = [k for k in required if d.get(k) is None]
    if missing:
        raise ConfigError([f"model.arch.{k}=None: required when model.arch is set ({source}); set it" for k in missing])
    d = dict(d)
    d["num_key_value_heads"] = d.get("num_key_value_heads") or d["num_attention_heads"]
    d["head_dim"] = d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]
    d.setdefault("max_position_embeddings", None)
    d["tie_word_embeddings"] = bool(d.get("tie_word_embeddings", False))
    d.setdefault("family", None)
    d["multimodal"] = bool(d.get("multimodal", False))
    for key in ("num_experts", "num_experts_per_tok", "moe_ffn_hidden_size", "shared_expert_ffn_hidden_size",
                *_LINEAR_FIELDS):
        d[key] = int(d.get(key) or 0)
    d["layer_types"] = _layer_types(d, source)
    if not d.get("ssm_state_bytes"):
        d["ssm_state_bytes"] = 4 if str(d["family"]).startswith("qwen3_5") else 2
    return ModelShape(source=source, **{k: d[k] for k in (f.name for f in fields(ModelShape)) if k != "source"})


def _layer_types(d: dict, source: str) -> tuple[str, ...]:
    """Each layer's kind from ``layer_types`` or, as transformers derives it, ``full_attention_interval`` (layer
    i is full attention when (i + 1) % interval == 0); () when the shape names no linear-attention layer."""
    n = int(d["num_layers"])
    if d.get("layer_types"):
        kinds = tuple(d["layer_types"])
        if LINEAR_ATTENTION not in kinds:       # a dense family's layer_types (its registry row checks them)
            return ()
        if len(kinds) != n or any(k not in (LINEAR_ATTENTION, FULL_ATTENTION) for k in kinds):
            raise ConfigError([f"layer_types={list(kinds)!r} ({source}): must name each of the {n} layers "
                               f"{LINEAR_ATTENTION!r} or {FULL_ATTENTION!r}"])
    elif d.get("full_attention_interval"):
        every = int(d["full_attention_interval"])
        kinds = tuple(FULL_ATTENTION if (i + 1) % every == 0 else LINEAR_ATTENTION for i in range(n))
    else:
        return ()
    if LINEAR_ATTENTION not in kinds:
        return ()
    missing = [k for k in _LINEAR_FIELDS if not d.get(k)]
    if missing:
        raise ConfigError([f"{k}=None ({source}): a shape with linear-attention layers needs the Gated DeltaNet "
                           f"sizes {', '.join(_LINEAR_FIELDS)}; set them" for k in missing])
    return kinds


# vLLM's names of a state dtype (mamba_ssm_dtype) and their sizes; "auto" is the model's bf16.
_SSM_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _dense_width(text: dict) -> Optional[int]:
    """``intermediate_size``; 0 for a mixture-of-experts config that has none (Qwen3.5-MoE: no dense MLP)."""
    width = text.get("intermediate_size")
    if width is None and (text.get("num_experts") or text.get("num_local_experts")):
        return 0
    return width


def _shape_from_hf(hf: dict, source: str) -> ModelShape:
    text = hf.get("text_config", hf)  # multimodal wrappers keep the LM under text_config
    archs = text.get("architectures") or hf.get("architectures") or []
    family = next((_HF_FAMILY[a] for a in archs if a in _HF_FAMILY), text.get("model_type"))
    return _complete(dict(
        num_layers=text.get("num_hidden_layers"), hidden_size=text.get("hidden_size"),
        num_attention_heads=text.get("num_attention_heads"), num_key_value_heads=text.get("num_key_value_heads"),
        ffn_hidden_size=_dense_width(text), vocab_size=text.get("vocab_size"),
        head_dim=text.get("head_dim"), max_position_embeddings=text.get("max_position_embeddings"),
        tie_word_embeddings=hf.get("tie_word_embeddings", text.get("tie_word_embeddings", False)),
        family=family, num_experts=text.get("num_experts") or text.get("num_local_experts"),
        num_experts_per_tok=text.get("num_experts_per_tok"), moe_ffn_hidden_size=text.get("moe_intermediate_size"),
        multimodal="text_config" in hf, shared_expert_ffn_hidden_size=text.get("shared_expert_intermediate_size"),
        layer_types=text.get("layer_types"), full_attention_interval=text.get("full_attention_interval"),
        ssm_state_bytes=_SSM_DTYPE_BYTES.get(text.get("mamba_ssm_dtype"), 2) if str(text.get("model_type")).startswith(
            "qwen3_5") else 2,
        **{k: text.get(k) for k in _LINEAR_FIELDS}), source)


def model_shape(cfg: Any) -> ModelShape:
    """Shape of ``cfg.model`` from, in order: ``model.arch``; ``<model.path>/config.json`` on this machine;
    the built-in table of public shapes. Raises ConfigError (saying to set model.arch) when none applies."""
    cfg = as_dictconfig(cfg)
    if cfg.model.arch is not None:
        return _complete(OmegaConf.to_container(cfg.model.arch), "model.arch")
    path = str(cfg.model.path)
    cfg_json = os.path.join(os.path.expanduser(path), "config.json")
    if os.path.isfile(cfg_json):
        with open(cfg_json) as f:
            return _shape_from_hf(json.load(f), cfg_json)
    known = KNOWN_SHAPES.get(path.rstrip("/").lower())
    if known is not None:
        return _complete(known, "builtin table")
    raise ConfigError(
        f"model.path={path!r}: model shape unknown (no config.json there and not in the built-in table "
        f"{sorted(KNOWN_SHAPES)}); set model.arch (num_layers, hidden_size, num_attention_heads, "
        f"num_key_value_heads, ffn_hidden_size, vocab_size, ...)")

