"""Per-GPU memory and preemption-lead estimates for a parallel layout on a cluster shape (``mcpo plan``,
commands/plan.py, prints them before a job queues).

The config is validated for ``world = nodes x gpus_per_node`` (``config.validate``); then the memory of the
busiest GPU is estimated for the two phases of a colocated step (or for the training ranks and the engine ranks
with separate placement) and compared with the device. The estimates are first-order; the parameter, gradient and
optimizer terms are exact counts of megatron-core's tensors (tested against a built model on CPU).

* :mod:`~mcpo_megatron.planner.counts`: parameters, activations and attention scores of one rank (formulas of the
  model shape);
* :mod:`~mcpo_megatron.planner.engine`: the vLLM engine's share of a GPU and its KV cache;
* :mod:`~mcpo_megatron.planner.training`: the training phase's terms (weights, gradients, optimizer, activations,
  logits) and MoE routing replay's record;
* :mod:`~mcpo_megatron.planner.phases`: the two phases side by side and :func:`plan`, which refuses a layout that
  does not fit, naming the term and the fix;
* :mod:`~mcpo_megatron.planner.timing`: the preemption lead and the engine / training split of separate
  placement, from model FLOPs;
* :mod:`~mcpo_megatron.planner.formatting`: the tables ``mcpo plan`` prints.
"""

from mcpo_megatron.planner.common import GIB
from mcpo_megatron.planner.counts import (
    activation_bytes_per_token_layer,
    attention_score_bytes,
    layer_params_per_rank,
    layer_params_split,
    padded_query_groups,
    param_counts,
)
from mcpo_megatron.planner.engine import (
    DEFAULT_UTILIZATION,
    ENGINE_ALLOWANCE_GIB,
    ENGINE_ASLEEP_GIB,
    STANDALONE_MIN_SEQUENCES,
    engine_memory,
    estimate_engine_memory,
    smallest_engine_tp,
    vllm_splits,
)
from mcpo_megatron.planner.formatting import format_plan, format_preempt_lead, format_split
from mcpo_megatron.planner.phases import (
    DEFAULT_HOST_MEM_GIB,
    DEFAULT_OFFLOAD_GBPS,
    DEFAULT_RESERVE_GIB,
    Plan,
    colocated_engine_share,
    colocated_share,
    plan,
)
from mcpo_megatron.planner.timing import (
    CHECKPOINT_BYTES_PER_PARAM,
    DEFAULT_FS_WRITE_GBPS,
    DEFAULT_GEN_MFU,
    DEFAULT_MFU,
    H100_PEAK_TFLOPS,
    estimate_preempt_lead,
    step_work,
    suggest_split,
)
from mcpo_megatron.planner.training import Term, estimate_routing_record, estimate_training_memory

__all__ = [
    "GIB", "activation_bytes_per_token_layer", "attention_score_bytes", "layer_params_per_rank", "layer_params_split",
    "padded_query_groups", "param_counts", "ENGINE_ALLOWANCE_GIB", "ENGINE_ASLEEP_GIB", "STANDALONE_MIN_SEQUENCES",
    "engine_memory", "estimate_engine_memory", "smallest_engine_tp", "vllm_splits", "format_plan",
    "format_preempt_lead", "format_split", "DEFAULT_RESERVE_GIB", "DEFAULT_HOST_MEM_GIB", "DEFAULT_OFFLOAD_GBPS",
    "DEFAULT_UTILIZATION", "colocated_engine_share", "colocated_share", "Plan", "Term", "estimate_routing_record",
    "estimate_training_memory", "plan", "CHECKPOINT_BYTES_PER_PARAM", "DEFAULT_FS_WRITE_GBPS", "DEFAULT_GEN_MFU",
    "DEFAULT_MFU", "H100_PEAK_TFLOPS", "estimate_preempt_lead", "step_work", "suggest_split",
]
