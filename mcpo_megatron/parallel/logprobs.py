"""Per-token log-probabilities and entropy from vocabulary-parallel logits, in token chunks.

The last pipeline stage holds logits sharded over tensor-parallel ranks: rank
``r`` of ``tp`` holds vocabulary columns ``[r * V/tp, (r + 1) * V/tp)`` (megatron's
``VocabParallel`` partition).  For sampled tokens ``y`` and temperature ``T``,
with ``x = logits / T``::

    log p(y) = x_y - logsumexp(x)
    H        = logsumexp(x) - sum_v p_v x_v              (entropy of softmax(x))

``logsumexp`` over the whole vocabulary needs two TP all-reduces per chunk of
tokens: MAX of the per-rank maxima, then one SUM of (sum-exp, sum of exp*x,
target logit).  The backward needs no communication at all: with
``E[x] = logsumexp(x) - H`` saved per token,

    d log p(y) / d x_v = 1[v = y] - p_v
    d H        / d x_v = p_v (E[x] - x_v)

and ``p_v`` is recomputed chunk by chunk from the saved logits.  So no rank ever
holds a ``[tokens, vocab]`` tensor, nor more than one chunk's worth of
``[chunk, vocab/tp]`` float32 work space (two buffers, reused across chunks).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mcpo_megatron.parallel.distributed import all_reduce_max, all_reduce_sum


def _group_size_rank(group) -> tuple[int, int]:
    if group is None or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


class _VocabParallelLogProbs(torch.autograd.Function):
    """Autograd function behind :func:`vocab_parallel_logprobs` (2-D logits [N, V/tp])."""

    @staticmethod
    def forward(ctx, logits, targets, group, chunk_size, temperature, compute_entropy,
                inplace_backward):
        n, vp = logits.shape
        tp, tp_rank = _group_size_rank(group)
        compute_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        lse = torch.empty(n, dtype=compute_dtype, device=logits.device)
        mean_x = torch.empty(n, dtype=compute_dtype, device=logits.device) if compute_entropy else None
        logp = torch.empty(n, dtype=compute_dtype, device=logits.device)
        entropy = torch.empty(n if compute_entropy else 0, dtype=compute_dtype, device=logits.device)

        local_t, in_shard = _local_targets(targets, tp_rank, vp)
        c_max = min(chunk_size, max(n, 1))
        x_buf = torch.empty(c_max, vp, dtype=compute_dtype, device=logits.device)
        e_buf = torch.empty(c_max, vp, dtype=compute_dtype, device=logits.device)
        for start in range(0, n, chunk_size):
            end = min(start + chunk_size, n)
            c = end - start
            x, e = x_buf[:c], e_buf[:c]
            scaled = _scaled_chunk(logits[start:end], temperature, x)
            m = scaled.amax(dim=-1).to(compute_dtype)  # a maximum is exact in any dtype
            if tp > 1:
                all_reduce_max(m, group)  # on the logits' device
            torch.sub(scaled, m.unsqueeze(-1), out=x)  # shifted logits s = x - max, all <= 0 (computed in fp32+)
            target_s = x.gather(1, local_t[start:end].unsqueeze(-1)).squeeze(-1)
            target_s.mul_(in_shard[start:end])
            torch.exp(x, out=e)
            sums = [e.sum(dim=-1)]
            if compute_entropy:
                sums.append(e.mul_(x).sum(dim=-1))  # sum exp(s) * s
            sums.append(target_s)
            stats = torch.stack(sums)
            if tp > 1:
                all_reduce_sum(stats, group)
            log_sum = stats[0].log()
            logp[start:end] = stats[-1] - log_sum
            lse[start:end] = m + log_sum
            if compute_entropy:
                mean_s = stats[1] / stats[0]
                entropy[start:end] = log_sum - mean_s
                mean_x[start:end] = m + mean_s
        del x_buf, e_buf

        ctx.save_for_backward(logits, targets, lse, mean_x)
        ctx.group, ctx.chunk_size, ctx.temperature = group, chunk_size, temperature
        ctx.compute_entropy, ctx.inplace_backward = compute_entropy, inplace_backward
        if not compute_entropy:
            ctx.mark_non_differentiable(entropy)
        # An output no loss term reached comes to the backward as None, not as zeros: an entropy kept only
        # for its metric then costs the backward nothing.
        ctx.set_materialize_grads(False)
        out_dtype = logits.dtype if logits.dtype == torch.float64 else torch.float32
        return logp.to(out_dtype), entropy.to(out_dtype)

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        logits, targets, lse, mean_x = ctx.saved_tensors
        n, vp = logits.shape
        _, tp_rank = _group_size_rank(ctx.group)
        compute_dtype = lse.dtype
        chunk_size, temperature = ctx.chunk_size, ctx.temperature
        local_t, in_shard = _local_targets(targets, tp_rank, vp)
        g_lp = grad_logp.to(compute_dtype) if grad_logp is not None else lse.new_zeros(n)
        g_h = grad_entropy.to(compute_dtype) if ctx.compute_entropy and grad_entropy is not None else None

        # In-place: the gradient overwrites the (no longer needed) logits buffer, as
        # megatron's vocab-parallel cross-entropy does; autograd's version counter
        # flags any other saved use of these logits.
        grad = logits if ctx.inplace_backward else torch.empty_like(logits)
        c_max = min(chunk_size, max(n, 1))
        x_buf = torch.empty(c_max, vp, dtype=compute_dtype, device=logits.device)
        p_buf = torch.empty(c_max, vp, dtype=compute_dtype, device=logits.device)
        for start in range(0, n, chunk_size):
            end = min(start + chunk_size, n)
            c = end - start
            x, p = x_buf[:c], p_buf[:c]
            scaled = _scaled_chunk(logits[start:end], temperature, x)
            torch.sub(scaled, lse[start:end].unsqueeze(-1), out=p)
            p.exp_()
            g = g_lp[start:end].unsqueeze(-1)
            if g_h is not None:
                # p * (g_H (E[x] - x) - g_logp)
                torch.sub(scaled, mean_x[start:end].unsqueeze(-1), out=x)
                x.mul_(-g_h[start:end].unsqueeze(-1)).sub_(g)
                x.mul_(p)
            else:
                torch.mul(p, -g, out=x)
            x.scatter_add_(
                1, local_t[start:end].unsqueeze(-1), (g * in_shard[start:end].unsqueeze(-1))
            )
            if temperature != 1.0:
                x.div_(temperature)
            grad[start:end].copy_(x)
        return grad, None, None, None, None, None, None


def _scaled_chunk(chunk: torch.Tensor, temperature: float, buf: torch.Tensor) -> torch.Tensor:
    """``chunk / temperature``: the chunk itself at temperature 1 (read, never written: the ops that read it
    write into the compute-dtype work space, computing in its dtype), else its copy into ``buf`` divided there
    (a division of bf16 logits by a Python number would compute in bf16)."""
    if temperature == 1.0:
        return chunk
    buf.copy_(chunk)
    return buf.div_(temperature)


def _local_targets(targets: torch.Tensor, tp_rank: int, vp: int):
    """Targets as column indices into this rank's shard (clamped) and a 0/1 in-shard mask."""
    local = targets - tp_rank * vp
    in_shard = (local >= 0) & (local < vp)
    return local.clamp(0, vp - 1), in_shard


def vocab_parallel_logprobs(
    logits_shard: torch.Tensor,
    targets: torch.Tensor,
    tp_group=None,
    *,
    chunk_size: int = 4096,
    temperature: float = 1.0,
    compute_entropy: bool = True,
    inplace_backward: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probabilities of ``targets`` and softmax entropy from TP-sharded logits.

    Args:
        logits_shard: ``[..., V/tp]`` this rank's contiguous vocabulary slice
            (rank ``r`` holds global ids ``[r*V/tp, (r+1)*V/tp)``); bf16, fp16,
            fp32 (computed in fp32) or fp64 (computed in fp64).
        targets: ``[...]`` global token ids in ``[0, V)``, same leading shape (checked only when in host memory:
            a check of device ids would wait for the device).
        tp_group: tensor-parallel process group; ``None`` or a group of one
            means the shard is the whole vocabulary.
        chunk_size: tokens per chunk; work space is two ``[chunk, V/tp]``
            buffers of the compute dtype.
        temperature: logits are divided by it before the softmax (the rollout
            engine samples with the same temperature).
        compute_entropy: also return the entropy of ``softmax(logits / T)``.
        inplace_backward: write the gradient into ``logits_shard``'s storage
            instead of a new tensor (saves one ``[N, V/tp]`` buffer; the logits
            are overwritten by the backward pass).

    Returns:
        ``(logprobs, entropy)``, each shaped like ``targets`` (fp32, or fp64 for
        fp64 input); ``entropy`` is None when not requested.  Differentiable
        w.r.t. ``logits_shard``; every rank of the TP group gets the same
        values, and every rank must call this collectively.
    """
    if logits_shard.dim() < 1 or logits_shard.shape[:-1] != targets.shape:
        raise ValueError(
            f"vocab_parallel_logprobs: logits_shard shape {tuple(logits_shard.shape)} must be "
            f"targets shape {tuple(targets.shape)} plus a vocabulary dimension"
        )
    if targets.dtype not in (torch.int64, torch.int32):
        raise ValueError(
            f"vocab_parallel_logprobs: targets dtype {targets.dtype} must be int64 (token ids)"
        )
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"vocab_parallel_logprobs: chunk_size={chunk_size!r} must be a positive int")
    if not temperature > 0:
        raise ValueError(
            f"vocab_parallel_logprobs: temperature={temperature!r} must be > 0 "
            "(use the rollout temperature; greedy decoding corresponds to T=1 for log-probs)"
        )
    tp, _ = _group_size_rank(tp_group)
    vocab = logits_shard.shape[-1] * tp
    # Range-checked in host memory only: reading a device's min / max would make the host wait for the device on
    # every call. The policy checks its token ids on the host before they reach the device
    # (SequenceBatch.check_token_ids).
    if targets.device.type == "cpu" and targets.numel():
        lo, hi = int(targets.min()), int(targets.max())
        if lo < 0 or hi >= vocab:
            raise ValueError(
                f"vocab_parallel_logprobs: target ids span [{lo}, {hi}] "
                f"but the vocabulary has {vocab} entries ({logits_shard.shape[-1]} per rank x tp={tp}); "
                "check the tokenizer / padded vocabulary size"
            )
    lead = targets.shape
    logits2d = logits_shard.reshape(-1, logits_shard.shape[-1])
    if inplace_backward and not logits2d.is_contiguous():
        logits2d = logits2d.contiguous()
    logp, entropy = _VocabParallelLogProbs.apply(
        logits2d, targets.reshape(-1).long(), tp_group, chunk_size, float(temperature),
        compute_entropy, inplace_backward,
    )
    return logp.view(lead), (entropy.view(lead) if compute_entropy else None)
