"""Context parallelism (``parallelism.context_parallel_size``): each packed sequence split over the CP group.

megatron's load-balanced split (:mod:`~mcpo_megatron.parallel.context_split`): a sequence, padded to a multiple of
2 x CP, is cut into 2 x CP equal chunks and CP rank ``r`` holds chunks ``r`` and ``2 CP - 1 - r``.  With packed
sequences (THD) the split is per sequence: this rank's row is, sequence after sequence, its two chunks of each.
The cumulative lengths handed to attention stay those of the whole sequences (Transformer Engine and megatron's
THD rotary embedding divide them by CP themselves).

The response side keeps its [b, T] shape: a response token belongs to the CP rank holding the position that
predicts it; on the other ranks it is masked out and its token fields are 0, as on padding.  Each rank's loss
is then the sum over its own tokens with the global weights, the CP group's sum is the whole loss, megatron's
DDP sums gradients over data x context parallel ranks, and the global denominators are unchanged.  Log-probs
and entropy are 0 where a rank does not hold a token, so their sum over the CP group is the result.  Per-sequence
counts (the loss's ``seqs``) count a sequence on the rank that holds its first response token
(``MicroBatch.counted_rows``).
"""

from __future__ import annotations

import torch

from mcpo_megatron.models.batch import MicroBatch
from mcpo_megatron.models.packed_layout import PackedLayout
from mcpo_megatron.parallel.context_split import cp_chunk_positions


def local_positions(cu_seqlens_padded: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """Positions in a packed row (segments from ``cu_seqlens_padded``) that CP rank ``rank`` holds, in its order."""
    bounds = [int(x) for x in cu_seqlens_padded.tolist()]
    parts = [start + cp_chunk_positions(end - start, cp, rank) for start, end in zip(bounds[:-1], bounds[1:])]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def split_for_cp_rank(mb: MicroBatch, cp: int, rank: int) -> MicroBatch:
    """This CP rank's part of a packed micro-batch built with every segment a multiple of 2 x ``cp`` (module
    docstring)."""
    if mb.packing is None:
        raise ValueError("context parallelism splits packed micro-batches; set trainer.sequence_packing=true")
    mine = local_positions(mb.packing.cu_seqlens_padded, cp, rank)
    where = torch.full((mb.seq_length,), -1, dtype=torch.long)
    where[mine] = torch.arange(mine.numel())
    local_index = where[mb.resp_index]
    owned = mb.mask & (local_index >= 0)
    fields = {k: v.masked_fill(~owned, 0) for k, v in mb.token_fields.items()}
    layout = PackedLayout(cu_seqlens=mb.packing.cu_seqlens, cu_seqlens_padded=mb.packing.cu_seqlens_padded,
                          max_seqlen=mb.packing.max_seqlen, token_mask=mb.packing.token_mask[:, mine])
    return MicroBatch(indices=list(mb.indices), input_ids=mb.input_ids[:, mine],
                      position_ids=mb.position_ids[:, mine], resp_index=local_index.clamp(min=0).masked_fill(~owned, 0),
                      targets=mb.targets.masked_fill(~owned, 0), mask=owned, token_fields=fields,
                      seq_fields=dict(mb.seq_fields), prompt_lens=mb.prompt_lens, response_lens=mb.response_lens,
                      filler=mb.filler, packing=layout, counted_rows=owned[:, 0])
