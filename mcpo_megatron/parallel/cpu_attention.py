"""A reference core attention for megatron's local layer spec: packed sequences (THD).

On GPUs Transformer Engine's ``TEDotProductAttention`` implements them.  megatron's local ``DotProductAttention``
refuses them (it asserts ``packed_seq_params is None``), so the CPU layer spec swaps in
:class:`ReferenceDotProductAttention`, which keeps TE's contract: ``query`` [t, np, hn], ``key`` / ``value``
[t, ng, hn] (the batch axis squeezed out by megatron's attention), sequences laid out by
``cu_seqlens_q_padded``; each query attends causally to the keys of its own sequence only.  Returns
[t, np * hn].

Everything else (no packed parameters) goes to megatron's own ``DotProductAttention`` unchanged.  It is correct,
not fast (one score matrix per sequence): its purpose is that the packed data path runs, and is tested, without
a GPU.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                      k_pos: torch.Tensor, scale: float, dropout) -> torch.Tensor:
    """[s_q, np, hn] attention of ``q`` over ``k``/``v`` [s_k, np, hn] where key position <= query position;
    scores and softmax in fp32."""
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    allowed = k_pos[None, :] <= q_pos[:, None]
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    probs = dropout(probs).to(v.dtype)
    return torch.einsum("hqk,khd->qhd", probs, v)


class ReferenceDotProductAttention(DotProductAttention):
    """megatron's ``DotProductAttention`` with THD (module docstring)."""

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias)
        if packed_seq_params.qkv_format != "thd" or attention_bias is not None:
            raise NotImplementedError(f"ReferenceDotProductAttention: qkv_format="
                                      f"{packed_seq_params.qkv_format!r} with attention_bias="
                                      f"{attention_bias is not None}; only 'thd' without a bias")
        groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if groups > 1:
            key = key.repeat_interleave(groups, dim=1)
            value = value.repeat_interleave(groups, dim=1)
        cu = packed_seq_params.cu_seqlens_q_padded
        if cu is None:
            cu = packed_seq_params.cu_seqlens_q
        bounds = [int(x) for x in cu.tolist()]
        out = [_causal_attention(query[s:e], key[s:e], value[s:e], torch.arange(e - s), torch.arange(e - s),
                                 self.softmax_scale, self._dropout)
               for s, e in zip(bounds[:-1], bounds[1:]) if e > s]
        context = torch.cat(out) if out else query.new_zeros((0,) + tuple(query.shape[1:]))
        return context.reshape(context.shape[0], -1)

    def _dropout(self, probs: torch.Tensor) -> torch.Tensor:
        from megatron.core import tensor_parallel

        if not self.training or self.attention_dropout.p == 0:
            return probs
        with tensor_parallel.get_cuda_rng_tracker().fork():
            return self.attention_dropout(probs)
