"""A reference core attention for megatron's local layer spec: packed sequences (THD) and context parallelism.

On GPUs Transformer Engine's ``TEDotProductAttention`` implements both.  megatron's local
``DotProductAttention`` refuses them (it asserts ``packed_seq_params is None`` and
``context_parallel_size == 1``), so the CPU layer spec swaps in :class:`ReferenceDotProductAttention`, which
keeps TE's contract:

* THD: ``query`` [t, np, hn], ``key`` / ``value`` [t, ng, hn] (the batch axis squeezed out by megatron's
  attention), sequences laid out by ``cu_seqlens_q_padded``; each query attends causally to the keys of its
  own sequence only.  Returns [t, np * hn].
* context parallelism (THD only): this rank holds, per sequence, chunk ``r`` and chunk ``2 CP - 1 - r`` of its
  2 x CP equal chunks (megatron's load-balanced order, :mod:`~mcpo_megatron.parallel.context_split`).  Keys
  and values are all-gathered over the CP group (the backward sums their gradients over it and keeps this
  rank's part), each sequence is put back in order, and the causal mask uses global positions.

Everything else (no packed parameters, CP = 1) goes to megatron's own ``DotProductAttention`` unchanged.  It is
correct, not fast (one score matrix per sequence, the whole of K and V on every CP rank): its purpose is that
the packed and context-parallel data path runs, and is tested, without a GPU. A GPU without Transformer Engine
runs it too (the local spec is what ``model.transformer_impl=auto`` picks there), so the positions and causal masks
it makes are made on the queries' device (tests/parallel/test_cpu_attention_device.py).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from megatron.core.transformer.dot_product_attention import DotProductAttention

from mcpo_megatron.parallel.context_split import cp_chunk_positions
from mcpo_megatron.parallel.distributed import all_gather, all_reduce_sum


class _GatherOverGroup(torch.autograd.Function):
    """[cp, *x.shape]: ``x`` of every rank of ``group``; the backward sums the gradient over the group and
    returns this rank's slice (gloo has all-gather and all-reduce, not reduce-scatter)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return torch.stack(all_gather(x.contiguous(), group))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = all_reduce_sum(grad.contiguous().clone(), ctx.group)  # the incoming gradient is not ours to change
        return grad[dist.get_rank(ctx.group)], None


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                      k_pos: torch.Tensor, scale: float, dropout=None) -> torch.Tensor:
    """[s_q, np, hn] attention of ``q`` over ``k``/``v`` [s_k, np, hn] where key position <= query position, in
    fp32: torch's fused attention, or with ``dropout`` (applied to the probabilities) the explicit softmax."""
    allowed = k_pos[None, :] <= q_pos[:, None]
    if dropout is None:
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1).float(), k.transpose(0, 1).float(), v.transpose(0, 1).float(), attn_mask=allowed,
            scale=scale)
        return out.transpose(0, 1).to(v.dtype)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return torch.einsum("hqk,khd->qhd", dropout(probs).to(v.dtype), v)


class ReferenceDotProductAttention(DotProductAttention):
    """megatron's ``DotProductAttention`` with THD and context parallelism (module docstring)."""

    def __init__(self, config, *args, **kwargs):
        # megatron's constructor refuses CP > 1; the per-head sizes it sets up do not depend on CP.
        unsplit = copy.copy(config)
        unsplit.context_parallel_size = 1
        super().__init__(unsplit, *args, **kwargs)
        self.config = config

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is None:
            if self.config.context_parallel_size > 1:
                raise NotImplementedError("ReferenceDotProductAttention: context parallelism needs packed "
                                          "sequences (trainer.sequence_packing=true)")
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
        cp_group = packed_seq_params.cp_group
        if cp_group is None and self.config.context_parallel_size > 1:
            from megatron.core import parallel_state

            cp_group = parallel_state.get_context_parallel_group()
        cp = 1 if cp_group is None else dist.get_world_size(cp_group)
        if cp > 1:
            out = self._context_parallel(query, key, value, bounds, cp_group, cp)
        else:
            out = []
            for s, e in zip(bounds[:-1], bounds[1:]):
                if e > s:
                    pos = torch.arange(e - s, device=query.device)
                    out.append(_causal_attention(query[s:e], key[s:e], value[s:e], pos, pos, self.softmax_scale,
                                                 self._dropout()))
        context = torch.cat(out) if out else query.new_zeros((0,) + tuple(query.shape[1:]))
        return context.reshape(context.shape[0], -1)

    def _context_parallel(self, query, key, value, bounds, cp_group, cp: int) -> list[torch.Tensor]:
        """Per sequence: this rank's queries (local offsets bounds / cp) over the whole sequence's keys."""
        rank = dist.get_rank(cp_group)
        device = query.device  # positions and masks live with the queries (a GPU's, without Transformer Engine)
        keys, values = _GatherOverGroup.apply(key, cp_group), _GatherOverGroup.apply(value, cp_group)
        out = []
        for s, e in zip(bounds[:-1], bounds[1:]):
            n = e - s
            if n == 0:
                continue
            lo, local = s // cp, n // cp
            # The whole sequence in order: rank r's tokens sit at cp_chunk_positions(n, cp, r).
            held = torch.cat([cp_chunk_positions(n, cp, r, device) for r in range(cp)])
            in_order = torch.argsort(held)
            k_full = keys[:, lo:lo + local].flatten(0, 1)[in_order]
            v_full = values[:, lo:lo + local].flatten(0, 1)[in_order]
            q_pos, k_pos = cp_chunk_positions(n, cp, rank, device), torch.arange(n, device=device)
            out.append(_causal_attention(query[lo:lo + local], k_full, v_full, q_pos, k_pos, self.softmax_scale,
                                         self._dropout()))
        return out

    def _dropout(self):
        """The attention dropout on the probabilities (megatron's: in the tensor-parallel RNG stream), or None
        when it does nothing (eval, or p = 0)."""
        from megatron.core import tensor_parallel

        if not self.training or self.attention_dropout.p == 0:
            return None

        def drop(probs: torch.Tensor) -> torch.Tensor:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                return self.attention_dropout(probs)

        return drop
