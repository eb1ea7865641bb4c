"""What the reward scorer grades by, its result type, and small helpers on lists of results."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass
from typing import Iterable

from mcpo_megatron.rewards.extract import ANSWER_FORMATS

#: Every status a :class:`RewardResult` can carry.
#: ``ok``: the verifier ran and compared an extracted answer with the gold;
#: ``no_answer``: no answer could be extracted from the response;
#: ``timeout``: the item overran its wall-clock deadline (its worker was killed);
#: ``crashed``: the worker died or raised (e.g. MemoryError under RLIMIT_AS).
STATUSES: tuple[str, ...] = ("ok", "no_answer", "timeout", "crashed")


@dataclass(frozen=True)
class Grading:
    """How a response is graded (docs/algorithms.md §14).

    answer_format: ``"dapo"`` (the last ``Answer:`` line parsed as LaTeX, else math-verify's own extraction: a
        ``\\boxed{}`` or its anchors), ``"boxed"`` (last ``\\boxed{}`` only), or ``"last_number"`` (the last number
        in the reply; lenient, for small models that ignore format instructions).
    correct_score / incorrect_score: reward of a correct / any other response (DAPO: +1 / -1).
    """

    answer_format: str = "dapo"
    correct_score: float = 1.0
    incorrect_score: float = -1.0

    def __post_init__(self):
        if self.answer_format not in ANSWER_FORMATS:
            raise ValueError(f"Grading: answer_format={self.answer_format!r} is invalid: must be one of "
                             f"{ANSWER_FORMATS}. Pass one of them.")
        object.__setattr__(self, "correct_score", float(self.correct_score))
        object.__setattr__(self, "incorrect_score", float(self.incorrect_score))

    def score(self, correct: bool) -> float:
        return self.correct_score if correct else self.incorrect_score


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
