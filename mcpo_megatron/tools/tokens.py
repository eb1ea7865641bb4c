"""The token cap of a tool output: applied by the episode code to the output's token ids, with the run's
tokenizer, before they are appended (the sandbox's own cap, ``max_output_bytes``, is on the bytes it reads)."""

from __future__ import annotations

from typing import Sequence


def truncate_tokens(ids: Sequence[int], max_tokens: int, marker: Sequence[int] = ()) -> tuple[list[int], bool]:
    """``(ids, False)`` when they fit in ``max_tokens``; else ``(head + marker + tail, True)`` of exactly
    ``max_tokens`` ids, the head one id longer than the tail when the room is odd: the output's start and its
    end (where a traceback names its error) both reach the model. ``marker``: the ids of a note such as
    ``"\\n[... output truncated ...]\\n"``, encoded by the caller."""
    if max_tokens < 1:
        raise ValueError(f"truncate_tokens: max_tokens={max_tokens} must be >= 1")
    ids = list(ids)
    if len(ids) <= max_tokens:
        return ids, False
    marker = list(marker)
    if len(marker) >= max_tokens:
        raise ValueError(f"truncate_tokens: the marker's {len(marker)} ids leave no room within "
                         f"max_tokens={max_tokens}")
    room = max_tokens - len(marker)
    head, tail = room - room // 2, room // 2
    return ids[:head] + marker + (ids[len(ids) - tail:] if tail else []), True
