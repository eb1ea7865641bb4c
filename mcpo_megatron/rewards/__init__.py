"""Rule-based math rewards: math-verify in killable worker processes (docs/algorithms.md §14)."""

from mcpo_megatron.rewards.extract import ANSWER_FORMATS, last_boxed, last_number
from mcpo_megatron.rewards.scorer import MathVerifyScorer, RewardPoolError
from mcpo_megatron.rewards.types import STATUSES, Grading, RewardResult, count_statuses, status_counts

__all__ = [
    "ANSWER_FORMATS",
    "STATUSES",
    "Grading",
    "MathVerifyScorer",
    "RewardPoolError",
    "RewardResult",
    "count_statuses",
    "last_boxed",
    "last_number",
    "status_counts",
]
