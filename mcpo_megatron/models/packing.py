"""Sequence packing (``trainer.sequence_packing``): micro-batches as token-budget bins of whole sequences in
megatron's THD form, and the balancing of sequences over data-parallel ranks.

A packed micro-batch concatenates its sequences into ONE row ``[1, T]`` (no per-row padding to the longest).
Attention must not cross sequences, so the model gets megatron's ``PackedSeqParams`` with
``qkv_format="thd"``: ``cu_seqlens_q/kv`` (cumulative real lengths), ``cu_seqlens_q/kv_padded`` (cumulative
lengths after padding each sequence to ``seq_multiple``) and ``max_seqlen_q/kv``.  Rotary positions restart at
0 in every sequence (megatron computes them from the padded cumulative lengths; ``position_ids`` say the same
for readers).  Tokens the bin adds after its last sequence (to reach a multiple of TP under sequence
parallelism, or the common length the interleaved schedule needs) form one more "sequence" of padding, which
attends only to itself.

The response side stays per sequence: ``resp_index`` [b, T] points into the packed row, so ``targets``,
``mask``, the token fields and every loss term and denominator are exactly those of the padded micro-batch,
and results come back per sequence unchanged.

Bins are filled first-fit decreasing over padded lengths (a sequence longer than the budget gets a bin of its
own).  Across data-parallel ranks, :func:`balanced_partition` (Karmarkar-Karp's largest differencing method)
spreads the sequences so that every rank gets about the same cost, in tokens or in estimated FLOPs (attention
grows with the square of a sequence's length).
"""

from __future__ import annotations

import heapq
from typing import Sequence

import torch

from mcpo_megatron.models.batch import MicroBatch, SequenceBatch, pad_response_width, pad_to_multiple
from mcpo_megatron.models.packed_layout import PackedLayout


def sequence_cost(length: int, balance: str) -> int:
    """The cost of one sequence for balancing: its tokens, or (``"flops"``) tokens plus the attention term
    length^2 / 2 scaled to tokens of a 4096-wide model (dense layers ~ 24 h^2 L, causal attention ~ 2 h L^2 per
    layer: the ratio is L / (12 h))."""
    if balance == "tokens":
        return int(length)
    if balance == "flops":
        return int(length) + int(length) * int(length) // (12 * 4096)
    raise ValueError(f"trainer.packing_balance={balance!r} must be 'tokens' or 'flops'")


def pack_bins(lengths: Sequence[int], max_tokens: int, *, seq_multiple: int = 1) -> list[list[int]]:
    """Indices grouped into bins whose padded lengths sum to at most ``max_tokens`` (first-fit decreasing).

    Sequences are taken longest first (ties by index, so the result is deterministic) and go into the first
    bin with room; a sequence longer than the budget gets a bin of its own.  Within a bin, indices keep that
    order.
    """
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens_per_microbatch={max_tokens!r} must be a positive integer (tokens per bin)")
    padded = [pad_to_multiple(int(n), seq_multiple) for n in lengths]
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(padded)), key=lambda i: (-padded[i], i)):
        for b, left in enumerate(room):
            if padded[i] <= left:
                bins[b].append(i)
                room[b] -= padded[i]
                break
        else:
            bins.append([i])
            room.append(max_tokens - padded[i])
    return bins


def balanced_partition(costs: Sequence[int], parts: int) -> list[list[int]]:
    """Indices split into ``parts`` sets of near-equal total cost (Karmarkar-Karp largest differencing).

    Each item starts as a partial solution (its cost in one set, the others empty); the two partial solutions
    with the largest spread are merged, heaviest set with lightest, until one remains.  Deterministic (ties by
    index).  Sets come back sorted by index; with fewer items than parts, some sets are empty.
    """
    if parts < 1:
        raise ValueError(f"balanced_partition: parts={parts!r} must be >= 1")
    heap = []
    for i, c in enumerate(costs):
        sets = [[i]] + [[] for _ in range(parts - 1)]
        sums = [int(c)] + [0] * (parts - 1)
        heapq.heappush(heap, (-(max(sums) - min(sums)), i, sums, sets))
    if not heap:
        return [[] for _ in range(parts)]
    while len(heap) > 1:
        _, key_a, sums_a, sets_a = heapq.heappop(heap)
        _, key_b, sums_b, sets_b = heapq.heappop(heap)
        order_a = sorted(range(parts), key=lambda k: -sums_a[k])  # heaviest first
        order_b = sorted(range(parts), key=lambda k: sums_b[k])  # lightest first
        sums = [sums_a[a] + sums_b[b] for a, b in zip(order_a, order_b)]
        sets = [sets_a[a] + sets_b[b] for a, b in zip(order_a, order_b)]
        heapq.heappush(heap, (-(max(sums) - min(sums)), min(key_a, key_b), sums, sets))
    _, _, sums, sets = heap[0]
    order = sorted(range(parts), key=lambda k: (-sums[k], min(sets[k], default=-1)))
    return [sorted(sets[k]) for k in order]


# ---------------------------------------------------------------------------------------------- micro-batches
def make_packed_microbatch(batch: SequenceBatch, indices: list[int], *, pad_id: int = 0, seq_multiple: int = 1,
                           total_multiple: int = 1, total_len: int | None = None) -> MicroBatch:
    """The sequences ``indices`` of ``batch`` packed into one row (module docstring).

    ``seq_multiple`` pads each sequence (context parallelism needs 2 x CP); the row is then padded to a
    multiple of ``total_multiple`` (TP under sequence parallelism) or to exactly ``total_len``.
    """
    b = len(indices)
    p_lens = batch.prompt_lens[indices].long()
    r_lens = batch.response_lens[indices].long()
    t = max(int(r_lens.max()) if b else 0, 1)
    seq_lens = [int(p) + int(r) for p, r in zip(p_lens, r_lens)]
    padded = [pad_to_multiple(n, seq_multiple) for n in seq_lens]
    used = sum(padded)
    total = pad_to_multiple(max(used, 1), total_multiple) if total_len is None else int(total_len)
    if total < used or total % total_multiple:
        raise ValueError(f"packed micro-batch: total_len={total} must hold its {used} tokens and be a multiple "
                         f"of {total_multiple}")
    input_ids = torch.full((1, total), pad_id, dtype=torch.long)
    position_ids = torch.zeros((1, total), dtype=torch.long)
    token_mask = torch.zeros((1, total), dtype=torch.bool)
    resp_index = torch.zeros((b, t), dtype=torch.long)
    targets = torch.zeros((b, t), dtype=torch.long)
    mask = torch.zeros((b, t), dtype=torch.bool)
    fields = {k: torch.zeros((b, t), dtype=v[indices[0]].dtype if v[indices[0]].is_floating_point()
                             else torch.float32) for k, v in batch.token_fields.items()}
    real, cum = [], []  # per non-empty segment: its real and its padded length
    offset = 0
    for row, i in enumerate(indices):
        n, p, r = seq_lens[row], int(p_lens[row]), int(r_lens[row])
        if n == 0:  # nothing to attend to; its (empty) response row stays masked
            continue
        input_ids[0, offset:offset + n] = batch.input_ids[i].long()
        position_ids[0, offset:offset + padded[row]] = torch.arange(padded[row])
        token_mask[0, offset:offset + n] = True
        if r > 0:
            resp_index[row, :r] = torch.arange(offset + p - 1, offset + p + r - 1)
            targets[row, :r] = batch.input_ids[i][p:p + r]
            mask[row, :r] = True
            for k, v in batch.token_fields.items():
                fields[k][row, :r] = v[i].to(fields[k].dtype)
        real.append(n)
        cum.append(padded[row])
        offset += padded[row]
    if total > used:  # the bin's own padding: one more segment, attending only to itself
        position_ids[0, used:] = torch.arange(total - used)
        real.append(total - used)
        cum.append(total - used)
    layout = PackedLayout(cu_seqlens=_cumulative(real), cu_seqlens_padded=_cumulative(cum),
                          max_seqlen=max(cum), token_mask=token_mask)
    idx = torch.as_tensor(indices, dtype=torch.long)
    return MicroBatch(indices=list(indices), input_ids=input_ids, position_ids=position_ids,
                      resp_index=resp_index, targets=targets, mask=mask, token_fields=fields,
                      seq_fields={k: v[idx] for k, v in batch.seq_fields.items()}, prompt_lens=p_lens,
                      response_lens=r_lens, packing=layout)


def _cumulative(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0).to(torch.int32)


def packed_filler(total_len: int, *, pad_id: int = 0, response_width: int = 1) -> MicroBatch:
    """A packed micro-batch of ``total_len`` padding tokens (one segment), marked ``filler``: it completes a
    schedule (the interleaved multiple of PP, the busiest rank's count) with no loss, gradient or results."""
    empty = SequenceBatch(input_ids=[torch.zeros(0, dtype=torch.long)], prompt_lens=torch.tensor([0]),
                          response_lens=torch.tensor([0]))
    mb = make_packed_microbatch(empty, [0], pad_id=pad_id, total_len=total_len)
    if response_width > 1:
        mb = pad_response_width(mb, response_width)
    mb.indices = []
    mb.filler = True
    return mb


def packed_microbatches(batch: SequenceBatch, max_tokens: int, *, pad_id: int = 0, seq_multiple: int = 1,
                        total_multiple: int = 1, fixed_shape: bool = False, num_multiple: int = 1
                        ) -> list[MicroBatch]:
    """Validate ``batch`` and pack it into bins of at most ``max_tokens`` padded tokens.

    With ``fixed_shape`` (megatron's interleaved schedule) every bin has the longest bin's length and the
    same response width, and fillers make the count a multiple of ``num_multiple``.
    """
    batch.validate()
    lengths = [int(x) for x in batch.seq_lens()]
    bins = pack_bins(lengths, max_tokens, seq_multiple=seq_multiple)
    total_len = None
    if fixed_shape:
        used = max(sum(pad_to_multiple(lengths[i], seq_multiple) for i in b) for b in bins)
        total_len = pad_to_multiple(max(used, 1), total_multiple)
    mbs = [make_packed_microbatch(batch, b, pad_id=pad_id, seq_multiple=seq_multiple,
                                  total_multiple=total_multiple, total_len=total_len) for b in bins]
    if not fixed_shape:
        return mbs
    width = max(mb.mask.shape[1] for mb in mbs)
    mbs = [pad_response_width(mb, width) if mb.mask.shape[1] < width else mb for mb in mbs]
    return mbs + [packed_filler(total_len, pad_id=pad_id, response_width=width)
                  for _ in range(-len(mbs) % num_multiple)]


def pad_packed_count(mbs: list[MicroBatch], count: int, *, pad_id: int = 0, total_multiple: int = 1,
                     fixed_shape: bool = False) -> list[MicroBatch]:
    """``mbs`` followed by packed fillers up to ``count`` (see ``batch.pad_microbatch_count`` for why); with
    ``fixed_shape`` they take the shape of ``mbs``, else they are ``total_multiple`` padding tokens."""
    if count < len(mbs):
        raise ValueError(f"pad_packed_count: count={count} is below the {len(mbs)} micro-batches given")
    if fixed_shape:
        total, width = mbs[0].seq_length, mbs[0].mask.shape[1]
    else:
        total, width = total_multiple, 1
    return mbs + [packed_filler(total, pad_id=pad_id, response_width=width) for _ in range(count - len(mbs))]
