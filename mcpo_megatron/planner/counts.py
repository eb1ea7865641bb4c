"""Parameters, activations and attention scores of one rank: formulas of the model shape alone.

Formulas (bytes; t = TP, p = PP, h = hidden, F = ffn hidden, V = vocab, T = tokens per micro-batch):

* parameters of the busiest pipeline stage on one TP rank: per layer ``(h*(q + 2*kv + q) + 3*h*F)/t`` linear
  weights (a mixture-of-experts layer instead of ``3*h*F/t``: its ``E/ep`` local experts of width ``I``,
  ``E/ep * 3*h*I/t`` (expert-TP = TP), plus the replicated router ``E*h``) (q = heads x head_dim, kv = query
  groups x head_dim, query groups padded to a multiple of t as megatron does) plus replicated norms (``2h``, and
  ``2*head_dim`` q/k norms for Qwen3, QKV biases for Qwen2), ``ceil(L/p)`` layers, the embedding ``V*h/t`` on
  the first stage and the output layer on the last (tied embeddings are shared only when p = 1);
* activations per token per layer: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
  Transformer Models", Eq. 2 (``sbh(10 + 24/t)`` bytes without sequence parallelism, ``34 sbh / t`` with it),
  re-derived for these models: no dropout, FlashAttention (no ``s^2`` scores; 4-byte softmax statistics per
  head), GQA, SwiGLU, Qwen3 q/k norms:
  ``2*(4h)`` replicated (norm inputs and linear inputs; divided by t with sequence parallelism) +
  ``2*(q + 2kv  +  (q + kv if q/k norms)  +  q  +  2F  +  F)/t`` + ``4*heads/t``; a MoE layer replaces the MLP
  terms ``2*(2F + F)/t`` by its k routed copies of each token, ``2*k*(2h + 3I/t)`` (permuted input, fc1 and
  activation outputs, expert output), and adds the fp32 router scores ``4*E``;
* attention scores, with megatron's unfused ``DotProductAttention`` (``model.transformer_impl=local``): each
  layer keeps the softmax probabilities of every query-key pair, ``heads/t * T * min(T, S)`` pairs for a
  micro-batch of ``T`` padded tokens whose sequences are at most ``S`` long, at 6 bytes a pair (the fp32 softmax
  output and its bf16 copy for the context matmul; 4 bytes in fp32, where they are one tensor), plus the layer's
  boolean causal mask, ``min(T, S)^2`` bytes.

Hybrid decoders (Qwen3.5, Qwen3-Next: ``shape.layer_types``) count each layer by its kind.  A full-attention
layer's query projection also makes the sigmoid output gate (``2q`` outputs instead of ``q``).  A Gated DeltaNet
layer (key heads ``nk`` of width ``dk``, value heads ``nv`` of width ``dv``, ``qk = nk*dk``, ``v = nv*dv``,
conv width ``K``) holds ``(h*(2qk + 2v + 2nv) + (2qk + v)*K + 2nv + v*h)/t`` weights (its input projection to
q, k, v, the gate z, beta and the decay a; the depthwise convolution over q, k, v; ``dt_bias`` and ``A_log``;
the output projection) and the replicated gated norm ``dv``; it keeps for backward, per token,
``2*((2qk + 2v + 2nv) + 2*(2qk + v) + 2qk + 2v)/t + 4*2nv/t`` bytes besides the replicated and MLP terms (the
projection's output, the convolution's output and its SiLU, the normalised q and k the chunked delta rule reads,
its output and the gated norm's; fp32 beta and decay), with no s^2 scores.  A MoE layer's gated shared expert
adds ``3*h*S/t`` weights and the replicated gate ``h``.

The parameter counts are exact counts of megatron-core's tensors (tested against a built model on CPU) and of
transformers' models (the hybrid MoE forms, which megatron does not build here yet).
"""

from __future__ import annotations

from typing import Any

from mcpo_megatron.accounting import layer_kinds
from mcpo_megatron.config.shapes import FULL_ATTENTION, LINEAR_ATTENTION


def padded_query_groups(kv_heads: int, tp: int) -> int:
    """Query groups megatron builds at TP ``tp``: ``kv_heads`` rounded up to a multiple of ``tp``."""
    return -(-kv_heads // tp) * tp

def moe_sizes(shape: Any) -> tuple[int, int, int]:
    """(experts, experts per token, expert width) of a mixture-of-experts shape; (0, 0, 0) when dense."""
    experts = int(getattr(shape, "num_experts", 0) or 0)
    if not experts:
        return 0, 0, 0
    return experts, int(shape.num_experts_per_tok), int(shape.moe_ffn_hidden_size)

def _is_hybrid(shape: Any) -> bool:
    return bool(getattr(shape, "layer_types", ()))


def _gdn_sizes(shape: Any) -> tuple[int, int, int, int, int]:
    """(qk, v, value heads, value head width, conv width) of a hybrid decoder's Gated DeltaNet layers."""
    qk = shape.linear_num_key_heads * shape.linear_key_head_dim
    v = shape.linear_num_value_heads * shape.linear_value_head_dim
    return qk, v, shape.linear_num_value_heads, shape.linear_value_head_dim, shape.linear_conv_kernel_dim


def _has_qk_norm(shape: Any) -> bool:
    return shape.family in ("qwen3", "qwen3_moe") or _is_hybrid(shape)


def layer_params_split(shape: Any, tp: int, ep: int = 1, kind: str = FULL_ATTENTION) -> tuple[int, int]:
    """(non-expert, expert) parameters of one decoder layer of ``kind`` held by one TP (and EP) rank."""
    h, hd, f = shape.hidden_size, shape.head_dim, shape.ffn_hidden_size
    n = 2 * h                                             # input and post-attention RMSNorm
    if kind == LINEAR_ATTENTION:
        qk, v, nv, dv, conv = _gdn_sizes(shape)
        n += (h * (2 * qk + 2 * v + 2 * nv) + (2 * qk + v) * conv + 2 * nv + v * h) // tp
        n += dv                                           # the gated RMSNorm over each value head
    else:
        groups = padded_query_groups(shape.num_key_value_heads, tp)
        heads = groups * (shape.num_attention_heads // shape.num_key_value_heads)
        q, kv = heads * hd, groups * hd
        gate = q if _is_hybrid(shape) else 0              # the output gate comes out of the query projection
        n += (h * (q + gate + 2 * kv) + q * h) // tp      # QKV (+ gate), output projection
        if _has_qk_norm(shape):
            n += 2 * hd                                   # q_norm, k_norm
        if shape.family == "qwen2":
            n += (q + 2 * kv) // tp                       # QKV biases
    experts, _, width = moe_sizes(shape)
    if experts:
        shared = int(getattr(shape, "shared_expert_ffn_hidden_size", 0) or 0)
        if shared:
            n += 3 * h * shared // tp + h                 # the shared expert and its sigmoid gate
        return n + experts * h, experts // ep * 3 * h * width // tp   # replicated router; local experts
    return n + 3 * h * f // tp, 0                         # fc1 (gate; up), fc2

def layer_params_per_rank(shape: Any, tp: int, ep: int = 1, kind: str = FULL_ATTENTION) -> int:
    """Parameters of one decoder layer of ``kind`` held by one TP rank (linear weights split, norms replicated;
    a MoE layer's experts split over EP and TP)."""
    return sum(layer_params_split(shape, tp, ep, kind))

def stage_layers(shape: Any, pp: int) -> list[list[int]]:
    """The global layer indices of each pipeline stage: ``ceil(L/pp)`` consecutive layers a stage."""
    per_stage = -(-shape.num_layers // pp)
    return [list(range(s * per_stage, min(shape.num_layers, (s + 1) * per_stage))) for s in range(pp)]

def param_counts(shape: Any, tp: int, pp: int, ep: int = 1) -> dict[str, int]:
    """Parameter counts: ``total`` (the HF model), per TP rank of the ``first`` and ``last`` pipeline stage,
    ``stage_max`` (the busiest stage), ``layers_per_stage``, and for MoE models ``expert_stage`` (the expert
    parameters of a stage on one rank, included in the stage counts) and ``total_active`` (parameters one token
    uses: k of E experts)."""
    h, v, layers = shape.hidden_size, shape.vocab_size, shape.num_layers
    per_stage = -(-layers // pp)
    kinds = layer_kinds(shape)
    split = {k: layer_params_split(shape, tp, ep, k) for k in set(kinds)}
    if _is_hybrid(shape):   # stages hold different mixes of layer kinds
        stages = [[kinds[i] for i in idx] for idx in stage_layers(shape, pp)]
    else:                   # every stage counted at ceil(L/pp) layers
        stages = [[kinds[0]] * per_stage] * pp
    stage_params = [sum(sum(split[k]) for k in ks) for ks in stages]
    stage_expert = [sum(split[k][1] for k in ks) for ks in stages]
    emb = v * h // tp
    out = 0 if (shape.tie_word_embeddings and pp == 1) else v * h // tp
    first = stage_params[0] + emb + (out + h if pp == 1 else 0)
    last = stage_params[-1] + out + h + (emb if pp == 1 else 0)
    full = {k: layer_params_split(shape, 1, 1, k) for k in set(kinds)}
    head = v * h * (1 if shape.tie_word_embeddings else 2) + h
    total = sum(sum(full[k]) for k in kinds) + head
    experts, topk, _ = moe_sizes(shape)
    active = sum(full[k][0] + (full[k][1] * topk // experts if experts else 0) for k in kinds) + head
    return dict(total=total, first=first, last=last, stage_max=max(first, last), layers_per_stage=per_stage,
                layer=max(sum(x) for x in split.values()), expert_stage=max(stage_expert), total_active=active,
                full_attention_per_stage=max(ks.count(FULL_ATTENTION) for ks in stages))

def activation_bytes_per_token_layer(shape: Any, tp: int, sequence_parallel: bool, dtype_bytes: int = 2,
                                     kind: str = FULL_ATTENTION) -> float:
    """Bytes one decoder layer of ``kind`` keeps for backward per token, without recomputation (see the module
    doc).

    ``dtype_bytes`` is the activation element size (2 for bf16); the softmax statistics are always fp32.
    """
    h, hd, f = shape.hidden_size, shape.head_dim, shape.ffn_hidden_size
    replicated = dtype_bytes * 4 * h                      # norm inputs + QKV / fc1 linear inputs
    if sequence_parallel:
        replicated /= tp
    experts, topk, width = moe_sizes(shape)
    if experts:   # k routed copies: permuted input, fc1 (gate; up) and activation outputs, expert output
        mlp = dtype_bytes * topk * (2 * h + 3 * width / tp) + 4 * experts
        shared = int(getattr(shape, "shared_expert_ffn_hidden_size", 0) or 0)
        mlp += dtype_bytes * 3 * shared / tp              # the shared expert's fc1 and activation outputs
    else:
        mlp = dtype_bytes * (2 * f + f) / tp
    if kind == LINEAR_ATTENTION:
        qk, v, nv, _, _ = _gdn_sizes(shape)
        mixer = (dtype_bytes * ((2 * qk + 2 * v + 2 * nv) + 2 * (2 * qk + v) + 2 * qk + 2 * v) / tp
                 + 4 * 2 * nv / tp)
        return replicated + mixer + mlp
    groups = padded_query_groups(shape.num_key_value_heads, tp)
    heads = groups * (shape.num_attention_heads // shape.num_key_value_heads)
    q, kv = heads * hd, groups * hd
    qk_norm = (q + kv) if _has_qk_norm(shape) else 0
    gate = 2 * q if _is_hybrid(shape) else 0              # the gate's projection output and its sigmoid
    split = dtype_bytes * (q + 2 * kv + qk_norm + q + gate) / tp + mlp + 4 * heads / tp
    return replicated + split

def attention_score_bytes(shape: Any, tp: int, tokens: int, longest: int, dtype_bytes: int = 2) -> float:
    """Bytes of one layer's softmax probabilities kept for backward by the local spec's unfused attention, for
    a micro-batch of ``tokens`` padded tokens whose sequences are at most ``longest`` long (see the module doc).

    A micro-batch of ``b`` rows padded to ``s`` tokens holds ``b * s * s`` pairs per head; ``b * s <= tokens``
    and ``s <= min(tokens, longest)`` bound them by ``tokens * min(tokens, longest)``. The causal mask (one
    byte a pair, one ``s x s`` tensor for all rows and heads) is built by each layer and kept by its masked fill.
    """
    groups = padded_query_groups(shape.num_key_value_heads, tp)
    heads = groups * (shape.num_attention_heads // shape.num_key_value_heads) // tp
    per_pair = 4 + (dtype_bytes if dtype_bytes < 4 else 0)   # fp32 softmax output (+ its bf16 copy)
    s = min(tokens, longest)
    return float(heads * tokens * s * per_pair + s * s)
