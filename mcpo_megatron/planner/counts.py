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

The parameter counts are exact counts of megatron-core's tensors (tested against a built model on CPU).
"""

from __future__ import annotations

from typing import Any


def padded_query_groups(kv_heads: int, tp: int) -> int:
    """Query groups megatron builds at TP ``tp``: ``kv_heads`` rounded up to a multiple of ``tp``."""
    return -(-kv_heads // tp) * tp

def moe_sizes(shape: Any) -> tuple[int, int, int]:
    """(experts, experts per token, expert width) of a mixture-of-experts shape; (0, 0, 0) when dense."""
    experts = int(getattr(shape, "num_experts", 0) or 0)
    if not experts:
        return 0, 0, 0
    return experts, int(shape.num_experts_per_tok), int(shape.moe_ffn_hidden_size)

def layer_params_split(shape: Any, tp: int, ep: int = 1) -> tuple[int, int]:
    """(non-expert, expert) parameters of one decoder layer held by one TP (and EP) rank."""
    h, hd, f = shape.hidden_size, shape.head_dim, shape.ffn_hidden_size
    groups = padded_query_groups(shape.num_key_value_heads, tp)
    heads = groups * (shape.num_attention_heads // shape.num_key_value_heads)
    q, kv = heads * hd, groups * hd
    n = (h * (q + 2 * kv) + q * h) // tp                  # QKV, output projection
    n += 2 * h                                            # input and post-attention RMSNorm
    if shape.family in ("qwen3", "qwen3_moe"):
        n += 2 * hd                                       # q_norm, k_norm
    if shape.family == "qwen2":
        n += (q + 2 * kv) // tp                           # QKV biases
    experts, _, width = moe_sizes(shape)
    if experts:
        return n + experts * h, experts // ep * 3 * h * width // tp   # replicated router; local experts
    return n + 3 * h * f // tp, 0                         # fc1 (gate; up), fc2

def layer_params_per_rank(shape: Any, tp: int, ep: int = 1) -> int:
    """Parameters of one decoder layer held by one TP rank (linear weights split, norms replicated; a MoE
    layer's experts split over EP and TP)."""
    return sum(layer_params_split(shape, tp, ep))

def param_counts(shape: Any, tp: int, pp: int, ep: int = 1) -> dict[str, int]:
    """Parameter counts: ``total`` (the HF model), per TP rank of the ``first`` and ``last`` pipeline stage,
    ``stage_max`` (the busiest stage), ``layers_per_stage``, and for MoE models ``expert_stage`` (the expert
    parameters of a stage on one rank, included in the stage counts) and ``total_active`` (parameters one token
    uses: k of E experts)."""
    h, v, layers = shape.hidden_size, shape.vocab_size, shape.num_layers
    per_stage = -(-layers // pp)
    dense, expert = layer_params_split(shape, tp, ep)
    layer = dense + expert
    emb = v * h // tp
    out = 0 if (shape.tie_word_embeddings and pp == 1) else v * h // tp
    first = per_stage * layer + emb + (out + h if pp == 1 else 0)
    last = per_stage * layer + out + h + (emb if pp == 1 else 0)
    full_dense, full_expert = layer_params_split(shape, 1, 1)
    head = v * h * (1 if shape.tie_word_embeddings else 2) + h
    total = layers * (full_dense + full_expert) + head
    experts, topk, _ = moe_sizes(shape)
    active = layers * (full_dense + (full_expert * topk // experts if experts else 0)) + head
    return dict(total=total, first=first, last=last, stage_max=max(first, last), layers_per_stage=per_stage,
                layer=layer, expert_stage=per_stage * expert, total_active=active)

def activation_bytes_per_token_layer(shape: Any, tp: int, sequence_parallel: bool, dtype_bytes: int = 2) -> float:
    """Bytes one decoder layer keeps for backward per token, without recomputation (see the module doc).

    ``dtype_bytes`` is the activation element size (2 for bf16); the softmax statistics are always fp32.
    """
    h, hd, f = shape.hidden_size, shape.head_dim, shape.ffn_hidden_size
    groups = padded_query_groups(shape.num_key_value_heads, tp)
    heads = groups * (shape.num_attention_heads // shape.num_key_value_heads)
    q, kv = heads * hd, groups * hd
    replicated = dtype_bytes * 4 * h                      # norm inputs + QKV / fc1 linear inputs
    if sequence_parallel:
        replicated /= tp
    qk_norm = (q + kv) if shape.family in ("qwen3", "qwen3_moe") else 0
    experts, topk, width = moe_sizes(shape)
    if experts:   # k routed copies: permuted input, fc1 (gate; up) and activation outputs, expert output
        mlp = dtype_bytes * topk * (2 * h + 3 * width / tp) + 4 * experts
    else:
        mlp = dtype_bytes * (2 * f + f) / tp
    split = dtype_bytes * (q + 2 * kv + qk_norm + q) / tp + mlp + 4 * heads / tp
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
