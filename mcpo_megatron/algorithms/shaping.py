"""DAPO's soft overlong punishment (DAPO paper, verl ``DAPORewardManager``; docs/algorithms.md §9).

With L_max = ``max_len`` and a buffer of ``cache_len`` tokens, a response of length |y| gets

    penalty(|y|) = min(0, -(|y| - (L_max - cache_len)) / cache_len * factor),

0 up to L_max - cache_len and falling linearly to -factor at L_max. The shaped reward is score + penalty.
"""

from __future__ import annotations

import torch


def overlong_penalty(lengths, max_len: int, cache_len: int, factor: float = 1.0) -> torch.Tensor:
    """Per-response penalty (<= 0) as float64, same shape as ``lengths`` (response token counts).

    At L_max 20480, cache 4096, factor 1 (docs/algorithms.md §9): 16384 -> 0, 17408 -> -0.25, 18432 -> -0.5,
    20480 -> -1.
    Lengths above ``max_len`` continue the line (verl does not clamp); rollouts never exceed it.
    """
    if not (isinstance(max_len, int) and max_len > 0):
        raise ValueError(f"max_len={max_len!r}: must be a positive integer (data.max_response_length).")
    if not (isinstance(cache_len, int) and 0 < cache_len <= max_len):
        raise ValueError(
            f"cache_len={cache_len!r}: must be an integer in (0, max_len={max_len}] (reward.overlong_buffer.len)."
        )
    if not factor >= 0:
        raise ValueError(f"factor={factor!r}: must be >= 0 (reward.overlong_buffer.penalty_factor).")
    lengths = torch.as_tensor(lengths)
    if bool((lengths < 0).any()):
        raise ValueError("lengths: response lengths must be >= 0.")
    exceed = lengths.to(torch.float64) - (max_len - cache_len)
    return torch.clamp(-exceed / cache_len * factor, max=0.0)
