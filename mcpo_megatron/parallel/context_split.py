"""megatron's load-balanced order of context parallelism: which tokens of a sequence each CP rank holds.

A sequence, padded to a multiple of 2 x CP, is cut into 2 x CP equal chunks; CP rank ``r`` holds chunk ``r`` and
chunk ``2 CP - 1 - r``, so that under a causal mask every rank does the same attention work (an early chunk with
few keys pairs with a late one with many).  Transformer Engine, megatron's THD rotary embedding, this package's
split of packed micro-batches (``models/context_parallel.py``) and the CPU's reference attention
(``parallel/cpu_attention.py``) all use this order.
"""

from __future__ import annotations

import torch


def cp_chunk_positions(padded_len: int, cp: int, rank: int,
                       device: torch.device | str | None = None) -> torch.Tensor:
    """Positions, in a sequence of ``padded_len`` tokens (a multiple of 2 x ``cp``), of the tokens CP rank
    ``rank`` holds: chunk ``rank`` then chunk ``2 cp - 1 - rank``; on ``device`` (default: the CPU), the device of
    the tensors they index or are compared with."""
    if padded_len % (2 * cp):
        raise ValueError(f"context parallelism: a sequence of {padded_len} padded tokens is not a multiple of "
                         f"2 x CP = {2 * cp}")
    c = padded_len // (2 * cp)
    return torch.cat([torch.arange(rank * c, (rank + 1) * c, device=device),
                      torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, device=device)])
