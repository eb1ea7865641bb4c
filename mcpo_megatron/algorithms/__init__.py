"""Pure tensor math of MCPO and its baselines (GRPO, DAPO, Dr.GRPO, GSPO, GCPO); no distributed code.

Spec: docs ``specs/algorithms.md`` of the design. Equation numbers refer to the MCPO paper.
"""

from .advantages import ESTIMATORS, STD_MODES, group_advantages, mcpo_scale
from .gcpo import Injection, inject_reference
from .kl import k3
from .losses import (
    FINAL_METRIC_KEYS,
    HINGE_AGGS,
    KL_TYPES,
    LOSS_AGG_MODES,
    METRIC_SUM_KEYS,
    RATIO_LEVELS,
    LossSettings,
    finalize_metrics,
    local_counts,
    policy_loss,
    token_weights,
)
from .mastery import GroupStats, MasteryTracker, group_stats, query_weight, sequence_mastered
from .metrics import bootstrap_best_at_k, expected_best_at_k, pass_at_k
from .sampling import dynamic_sampling_filter, kept_sequence_indices
from .shaping import overlong_penalty

__all__ = [
    "ESTIMATORS", "STD_MODES", "group_advantages", "mcpo_scale",
    "Injection", "inject_reference",
    "k3",
    "FINAL_METRIC_KEYS", "HINGE_AGGS", "KL_TYPES", "LOSS_AGG_MODES", "METRIC_SUM_KEYS", "RATIO_LEVELS",
    "LossSettings", "finalize_metrics", "local_counts",
    "policy_loss", "token_weights",
    "GroupStats", "MasteryTracker", "group_stats", "query_weight", "sequence_mastered",
    "bootstrap_best_at_k", "expected_best_at_k", "pass_at_k",
    "dynamic_sampling_filter", "kept_sequence_indices",
    "overlong_penalty",
]
