"""Record and report types shared by every prompt loader."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class PromptRecord:
    """One unique prompt.

    Attributes:
        uid: stable id (``<data_source>-<hash of the problem>`` unless the source has ids).
        problem: the bare problem text (no instructions).
        prompt: the text sent to the model (``format_prompt(problem, template)``), or chat
            messages ``[{"role": ..., "content": ...}]`` when the source ships them.
        ground_truth: the gold answer string (canonicalised, e.g. "27.0" -> "27").
        data_source: e.g. ``"math_dapo"``, ``"aime_2024"``, ``"reasoning_gym/basic_arithmetic"``.
        extra: source-specific fields (original index, raw answer, category, ...).
    """

    uid: str
    problem: str
    prompt: str | list[dict]
    ground_truth: str
    data_source: str
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class LoadReport:
    """What a loader did with the rows it read.

    ``rows_read``: rows in the source; ``unique_prompts``: distinct problems kept after dedupe;
    ``duplicates_dropped``: rows that repeated an earlier problem with the same answer;
    ``conflicting_dropped``: distinct problems dropped because their rows disagree on the answer;
    ``canonicalised``: gold answers rewritten (e.g. "27.0" -> "27"); ``returned``: records
    returned after ``num_samples`` subsampling.
    """

    source: str
    rows_read: int = 0
    unique_prompts: int = 0
    duplicates_dropped: int = 0
    conflicting_dropped: int = 0
    canonicalised: int = 0
    returned: int = 0

    def to_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        return (
            f"{self.source}: {self.rows_read} rows -> {self.unique_prompts} unique prompts "
            f"({self.duplicates_dropped} duplicate rows, {self.conflicting_dropped} conflicting prompts dropped, "
            f"{self.canonicalised} answers canonicalised), {self.returned} returned"
        )
