"""Pure tensor math of MCPO and its baselines (GRPO, DAPO, Dr.GRPO, GSPO, GCPO); no distributed code.

docs/algorithms.md defines every objective, estimator and metric computed here, in the notation of this code;
equation numbers refer to the MCPO paper unless another paper is named.
"""

from .advantages import ESTIMATORS, STD_MODES, group_advantages, mcpo_scale
from .aggregation import HINGE_AGGS, LOSS_AGG_MODES, local_counts, token_weights
from .gcpo import Injection, inject_reference
from .kl import k3
from .literal_loss import literal_policy_loss
from .loss_metrics import FINAL_METRIC_KEYS, METRIC_SUM_KEYS, finalize_metrics
from .loss_settings import KL_TYPES, RATIO_LEVELS, LossInputs, LossSettings
from .losses import policy_loss
from .mastery import GroupStats, MasteryTracker, group_stats, query_weight, sequence_mastered
from .metrics import bootstrap_best_at_k, expected_best_at_k, pass_at_k
from .sampling import dynamic_sampling_filter, kept_sequence_indices
from .shaping import overlong_penalty

__all__ = [
    "ESTIMATORS", "STD_MODES", "group_advantages", "mcpo_scale",
    "HINGE_AGGS", "LOSS_AGG_MODES", "local_counts", "token_weights",
    "Injection", "inject_reference",
    "k3",
    "FINAL_METRIC_KEYS", "METRIC_SUM_KEYS", "finalize_metrics",
    "KL_TYPES", "RATIO_LEVELS", "LossInputs", "LossSettings",
    "literal_policy_loss", "policy_loss",
    "GroupStats", "MasteryTracker", "group_stats", "query_weight", "sequence_mastered",
    "bootstrap_best_at_k", "expected_best_at_k", "pass_at_k",
    "dynamic_sampling_filter", "kept_sequence_indices",
    "overlong_penalty",
]
