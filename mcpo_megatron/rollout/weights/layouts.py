"""Both ends of a weight update in Hugging Face coordinates: where the trainer's ranks sit (:class:`TrainerLayout`)
and what an engine rank holds (:class:`EngineLayout`), listed as :class:`Fill` rows (pure).

**Destinations** (:func:`engine_fills`): an engine layout lists its tensors as :class:`Fill` rows, "rows/columns
R x C of HF tensor X land at this view of destination D". The PyTorch engine's tensors are the HF tensors (a
mixture-of-experts layer's experts fused into ``[E, 2I, h]`` / ``[E, h, I]`` by transformers 5); vLLM's are its
rank's shards of the fused ``qkv_proj`` (its query heads, then its key and value heads, replicated when its TP
exceeds the KV heads), ``gate_up_proj`` (its gate rows, then its up rows), the column shards of ``o_proj`` /
``down_proj``, the padded vocabulary rows of the embedding and LM head, and the fused experts ``w13_weight``
``[E, 2I/R, h]`` / ``w2_weight`` ``[E, h, I/R]``. :func:`engine_tensor_shapes` is what an engine must allocate
for them. The plan that fills them is ``rollout/weights/plan.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

from mcpo_megatron.models import weights
from mcpo_megatron.models.registry import MegatronShape
from mcpo_megatron.models.shard_views import Rect, View, contiguous_view, rect_of

VLLM_EXPERTS = "mlp.experts.routed_experts"   # vLLM 0.32's module holding a MoE layer's fused experts
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}


# --------------------------------------------------------------------------------------------------- layouts
@dataclass(frozen=True)
class TrainerRank:
    """Where a trainer rank sits (Megatron's coordinates): pipeline stage, tensor rank, data and context replica,
    and in the experts' layout its expert-parallel rank and expert data replica. ``rank`` is its rank in the
    transfer group."""

    rank: int
    pp: int
    tp: int
    dp: int = 0
    cp: int = 0
    ep: int = 0
    edp: int = 0


@dataclass(frozen=True)
class TrainerLayout:
    """The sources: the model's shape at the trainer's TP/EP, its layer spec, which pipeline stage holds each
    layer (virtual stages folded in) and every trainer rank's coordinates."""

    shape: MegatronShape
    te: bool
    layer_stage: tuple[int, ...]
    ranks: tuple[TrainerRank, ...]

    @property
    def pp(self) -> int:
        return max(r.pp for r in self.ranks) + 1


@dataclass(frozen=True)
class EngineLayout:
    """What an engine rank holds.

    ``kind`` "hf": the Hugging Face tensors whole (the PyTorch engine), experts fused as transformers 5 does
    (``fused_experts``). ``kind`` "vllm": vLLM's tensor-parallel rank ``tp_rank`` of ``tp`` with its vocabulary
    padded to ``vocab_padded`` rows. ``dtype``: the engine's weight dtype (what travels). ``replica`` / ``tp_rank``
    spread an engine rank's sources over the trainer's replicas when it is not itself a trainer rank."""

    kind: str
    dtype: str
    tp: int = 1
    tp_rank: int = 0
    vocab_padded: int = 0
    fused_experts: bool = True
    replica: int = 0

    def __post_init__(self):
        if self.kind not in ("hf", "vllm"):
            raise ValueError(f"EngineLayout.kind={self.kind!r} must be 'hf' or 'vllm'")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"EngineLayout.dtype={self.dtype!r} must be one of {sorted(DTYPE_BYTES)}")


class Fill(NamedTuple):
    """Rectangle ``rect`` of HF tensor ``hf`` lands at ``dst`` (whose shape is the rectangle's)."""

    dst: View
    hf: str
    rect: Rect



# --------------------------------------------------------------------------------------------------- destinations
def engine_tensor_shapes(shape: MegatronShape, layout: EngineLayout) -> dict[str, tuple[int, ...]]:
    """Every destination tensor of ``layout`` and its shape (what the engine must hold)."""
    hf_shapes = _hf_shapes(shape) if layout.kind == "hf" else {}
    out: dict[str, tuple[int, ...]] = {}
    for f in engine_fills(shape, layout):
        if f.dst.key not in out:
            out[f.dst.key] = _full_shape(shape, layout, f.dst.key, hf_shapes)
    return out


def _full_shape(shape: MegatronShape, layout: EngineLayout, key: str,
                hf_shapes: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
    h, hd, r = shape.hidden_size, shape.head_dim, layout.tp
    leaf = key.rsplit(".", 2)
    if layout.kind == "hf":
        if key.endswith("mlp.experts.gate_up_proj"):
            return (shape.num_experts, 2 * shape.moe_ffn_hidden_size, h)
        if key.endswith("mlp.experts.down_proj"):
            return (shape.num_experts, h, shape.moe_ffn_hidden_size)
        return hf_shapes[key]
    if key in ("model.embed_tokens.weight", "lm_head.weight"):
        return (layout.vocab_padded // r, h)
    if key.endswith("qkv_proj.weight") or key.endswith("qkv_proj.bias"):
        nq, nk, _ = _vllm_heads(shape, layout)
        rows = (nq + 2 * nk) * hd
        return (rows, h) if key.endswith("weight") else (rows,)
    if key.endswith("o_proj.weight"):
        return (h, shape.hf_heads // r * hd)
    if key.endswith("gate_up_proj.weight"):
        return (2 * shape.ffn_hidden_size // r, h)
    if key.endswith("down_proj.weight"):
        return (h, shape.ffn_hidden_size // r)
    if key.endswith("w13_weight"):
        return (shape.num_experts, 2 * shape.moe_ffn_hidden_size // r, h)
    if key.endswith("w2_weight"):
        return (shape.num_experts, h, shape.moe_ffn_hidden_size // r)
    if key.endswith("mlp.gate.weight"):
        return (shape.num_experts, h)
    if leaf[-2] in ("q_norm", "k_norm"):
        return (hd,)
    return (h,)  # RMSNorm weights


def _hf_shapes(shape: MegatronShape) -> dict[str, tuple[int, ...]]:
    out = {}
    for rule in weights.param_rules(shape):
        for name, s in zip(rule.hf, weights.hf_tensor_shapes(shape, rule)):
            out[name] = tuple(s)
    return out


def _vllm_heads(shape: MegatronShape, layout: EngineLayout) -> tuple[int, int, int]:
    """(query heads, KV heads, first KV head) of vLLM's TP rank: KV heads split, or replicated when TP > KV heads."""
    r, j = layout.tp, layout.tp_rank
    if shape.hf_heads % r:
        raise ValueError(f"vLLM at tensor-parallel size {r} needs num_attention_heads={shape.hf_heads} divisible by "
                         "it; choose rollout.tensor_parallel_size that divides the heads")
    kv = shape.hf_kv_heads
    if kv >= r:
        if kv % r:
            raise ValueError(f"vLLM at tensor-parallel size {r} needs num_key_value_heads={kv} divisible by it (or "
                             "a multiple of it); choose another rollout.tensor_parallel_size")
        return shape.hf_heads // r, kv // r, j * (kv // r)
    if r % kv:
        raise ValueError(f"vLLM at tensor-parallel size {r} > num_key_value_heads={kv} needs the TP size to be a "
                         "multiple of the KV heads; choose another rollout.tensor_parallel_size")
    return shape.hf_heads // r, 1, j // (r // kv)


def engine_fills(shape: MegatronShape, layout: EngineLayout) -> list[Fill]:
    """The destination tensors of ``layout`` as HF rectangles, in the model's HF order (embeddings, layers, final
    norm, head). Tied heads are not listed: the engine's head shares the embedding's tensor."""
    if layout.kind == "hf":
        return _hf_fills(shape, layout)
    return _vllm_fills(shape, layout)


def _whole(key: str, hf: str, hf_shape: Sequence[int]) -> Fill:
    return Fill(contiguous_view(key, hf_shape), hf, rect_of(hf_shape))


def _hf_fills(shape: MegatronShape, layout: EngineLayout) -> list[Fill]:
    fills = []
    for rule in weights.param_rules(shape):
        for name, hf_shape in zip(rule.hf, weights.hf_tensor_shapes(shape, rule)):
            if rule.expert is None or not layout.fused_experts:
                fills.append(_whole(name, name, hf_shape))
                continue
            e, inter, h = rule.expert, shape.moe_ffn_hidden_size, shape.hidden_size
            prefix = f"model.layers.{rule.layer}.mlp.experts"
            if name.endswith("down_proj.weight"):
                fills.append(Fill(View(f"{prefix}.down_proj", (h, inter), (inter, 1), e * h * inter), name,
                                  rect_of(hf_shape)))
            else:
                up = name.endswith("up_proj.weight")
                offset = e * 2 * inter * h + (inter * h if up else 0)
                fills.append(Fill(View(f"{prefix}.gate_up_proj", (inter, h), (h, 1), offset), name,
                                  rect_of(hf_shape)))
    return fills


def _vllm_fills(shape: MegatronShape, layout: EngineLayout) -> list[Fill]:
    r, j, h, hd = layout.tp, layout.tp_rank, shape.hidden_size, shape.head_dim
    if layout.vocab_padded < shape.vocab_size or layout.vocab_padded % r:
        raise ValueError(f"vLLM's padded vocabulary {layout.vocab_padded} must cover vocab_size={shape.vocab_size} "
                         f"and divide by its tensor-parallel size {r}")
    nq, nk, k0 = _vllm_heads(shape, layout)
    fills: list[Fill] = []

    def vocab(key: str, hf: str) -> None:
        per = layout.vocab_padded // r
        start, stop = j * per, min((j + 1) * per, shape.vocab_size)
        if stop > start:
            dst = contiguous_view(key, (per, h)).index(0, 0, stop - start)
            fills.append(Fill(dst, hf, ((start, stop), (0, h))))

    def rows(key: str, full: tuple[int, ...], at: int, hf: str, start: int, stop: int) -> None:
        """HF rows [start, stop) (all columns) land at rows [at, ...) of ``key``."""
        dst = contiguous_view(key, full).index(0, at, at + stop - start)
        fills.append(Fill(dst, hf, ((start, stop),) + tuple((0, s) for s in full[1:])))

    def cols(key: str, full: tuple[int, int], hf: str, start: int, stop: int) -> None:
        fills.append(Fill(contiguous_view(key, full), hf, ((0, full[0]), (start, stop))))

    vocab("model.embed_tokens.weight", weights.HF_EMBED)
    for layer in range(shape.num_layers):
        hf, v = f"model.layers.{layer}.", f"model.layers.{layer}."
        fills.append(_whole(v + "input_layernorm.weight", hf + "input_layernorm.weight", (h,)))
        for part in ("weight", "bias") if shape.arch.qkv_bias else ("weight",):
            full = ((nq + 2 * nk) * hd, h) if part == "weight" else ((nq + 2 * nk) * hd,)
            key = v + f"self_attn.qkv_proj.{part}"
            rows(key, full, 0, hf + f"self_attn.q_proj.{part}", j * nq * hd, (j + 1) * nq * hd)
            rows(key, full, nq * hd, hf + f"self_attn.k_proj.{part}", k0 * hd, (k0 + nk) * hd)
            rows(key, full, (nq + nk) * hd, hf + f"self_attn.v_proj.{part}", k0 * hd, (k0 + nk) * hd)
        if shape.arch.qk_norm:
            fills.append(_whole(v + "self_attn.q_norm.weight", hf + "self_attn.q_norm.weight", (hd,)))
            fills.append(_whole(v + "self_attn.k_norm.weight", hf + "self_attn.k_norm.weight", (hd,)))
        cols(v + "self_attn.o_proj.weight", (h, nq * hd), hf + "self_attn.o_proj.weight", j * nq * hd,
             (j + 1) * nq * hd)
        fills.append(_whole(v + "post_attention_layernorm.weight", hf + "post_attention_layernorm.weight", (h,)))
        if shape.is_moe:
            fills.append(_whole(v + "mlp.gate.weight", hf + "mlp.gate.weight", (shape.num_experts, h)))
            inter = shape.moe_ffn_hidden_size
            if inter % r:
                raise ValueError(f"vLLM at tensor-parallel size {r} needs moe_intermediate_size={inter} divisible "
                                 "by it")
            i_r = inter // r
            w13 = contiguous_view(v + VLLM_EXPERTS + ".w13_weight", (shape.num_experts, 2 * i_r, h))
            w2 = contiguous_view(v + VLLM_EXPERTS + ".w2_weight", (shape.num_experts, h, i_r))
            for e in range(shape.num_experts):
                ex = hf + f"mlp.experts.{e}."
                base = e * 2 * i_r * h
                fills.append(Fill(View(w13.key, (i_r, h), (h, 1), base), ex + "gate_proj.weight",
                                  ((j * i_r, (j + 1) * i_r), (0, h))))
                fills.append(Fill(View(w13.key, (i_r, h), (h, 1), base + i_r * h), ex + "up_proj.weight",
                                  ((j * i_r, (j + 1) * i_r), (0, h))))
                fills.append(Fill(View(w2.key, (h, i_r), (i_r, 1), e * h * i_r), ex + "down_proj.weight",
                                  ((0, h), (j * i_r, (j + 1) * i_r))))
        else:
            f = shape.ffn_hidden_size
            if f % r:
                raise ValueError(f"vLLM at tensor-parallel size {r} needs intermediate_size={f} divisible by it")
            f_r = f // r
            key = v + "mlp.gate_up_proj.weight"
            rows(key, (2 * f_r, h), 0, hf + "mlp.gate_proj.weight", j * f_r, (j + 1) * f_r)
            rows(key, (2 * f_r, h), f_r, hf + "mlp.up_proj.weight", j * f_r, (j + 1) * f_r)
            cols(v + "mlp.down_proj.weight", (h, f_r), hf + "mlp.down_proj.weight", j * f_r, (j + 1) * f_r)
    fills.append(_whole("model.norm.weight", weights.HF_FINAL_NORM, (h,)))
    if not shape.tie_word_embeddings:
        vocab("lm_head.weight", weights.HF_LM_HEAD)
    return fills
