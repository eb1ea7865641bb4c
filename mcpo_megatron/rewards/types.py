"""Result type of the reward scorer and small helpers on lists of results."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass
from typing import Iterable

#: Every status a :class:`RewardResult` can carry.
#: ``ok``: the verifier ran and compared an extracted answer with the gold;
#: ``no_answer``: no answer could be extracted from the response;
#: ``timeout``: the item overran its wall-clock deadline (its worker was killed);
#: ``crashed``: the worker died or raised (e.g. MemoryError under RLIMIT_AS).
STATUSES: tuple[str, ...] = ("ok", "no_answer", "timeout", "crashed")


@dataclass(frozen=True)
class RewardResult:
    """Reward of one response.

    ``score`` is ``correct_score`` when ``correct`` is 1, else ``incorrect_score``
    (+1 / -1 in the DAPO convention).  ``truncated`` repeats the caller's flag (the
    response hit the generation length limit) so the trainer can shape or filter it.
    """

    score: float
    correct: int
    status: str
    extracted: str | None
    truncated: bool

    def to_dict(self) -> dict:
        return asdict(self)


def status_counts(results: Iterable[RewardResult]) -> dict[str, int]:
    """Count results per status; every status in :data:`STATUSES` is present (0 if unseen)."""
    return count_statuses(r.status for r in results)


def count_statuses(statuses: Iterable[str]) -> dict[str, int]:
    """Count status strings; every status in :data:`STATUSES` is present (0 if unseen). A status not in
    :data:`STATUSES` is an error (it would be left out of every count)."""
    counts = Counter(statuses)
    unknown = sorted(set(counts) - set(STATUSES))
    if unknown:
        raise ValueError(f"unknown reward status {unknown[0]!r}: not one of rewards.types.STATUSES {STATUSES}")
    return {s: int(counts.get(s, 0)) for s in STATUSES}
