"""How the policy computes: the settings :class:`~mcpo_megatron.models.policy.MegatronPolicy` and its frozen twin
:class:`~mcpo_megatron.models.reference.ReferencePolicy` are built with, one typed object made once from the config
(``trainer/components.policy_settings``) or by a test or benchmark.

The reference takes the policy's own settings, so that both compute the same log-probs (the same dtype,
micro-batching, kernel chunks, temperature, sequence parallelism and packing); it ignores what concerns training
only (the optimizer, overlaps, recomputation, the MoE auxiliary loss and routing replay).

The checks here name the settings' own fields; the config keys they come from are the schema's to name
(``mcpo_megatron/config``), which checks them before any process group starts.
"""

from __future__ import annotations

import dataclasses

import torch

from mcpo_megatron.models.optim import OptimSettings
from mcpo_megatron.models.passes import as_dtype
from mcpo_megatron.models.routing_replay import MODES as ROUTING_REPLAY_MODES


@dataclasses.dataclass(frozen=True)
class PolicySettings:
    """Args:
        dtype: parameter dtype (a torch dtype or a config name); None: bf16 with CUDA, fp32 on CPU.
        optim: optimizer / LR-schedule settings (:meth:`OptimSettings.from_config`).
        max_tokens_per_microbatch: padded-token budget of one micro-batch (b * S_max).
        logprob_chunk_size: tokens per chunk in the vocab-parallel log-prob kernel.
        temperature: logits are divided by it before the softmax (must equal the rollout's).
        transformer_impl: "auto" (TE on GPUs when installed, else local), "local" or "transformer_engine".
        sequence_parallel: split activations outside the TP-parallel matmuls along the sequence (needs TP > 1;
            ignored at TP = 1; required for MoE at TP > 1).
        recompute_activations: keep only each layer's input for backward and run the layer again there
            (megatron's full, uniform recomputation of 1 layer at a time).
        moe_aux_loss_coeff: weight of the MoE load-balancing loss in the gradient (0: the load is only reported;
            see :mod:`~mcpo_megatron.models.moe_balance`).
        overlap_grad_reduce: megatron DDP reduces each gradient bucket as soon as the backward pass has produced
            it, overlapping communication with the rest of the backward.
        overlap_param_gather: the distributed optimizer's parameter all-gather after a step is deferred to the
            next forward and overlapped with it (bucket by bucket); until then only this rank's shard of the
            parameters is updated, so readers outside a forward call ``MegatronPolicy.sync_params`` first.
        moe_routing_replay: "off", "r2" (``compute_logprobs`` records each token's experts into a batch that has
            no record, later passes over it replay them) or "r3" (passes replay the batch's record, the engine's);
            see :mod:`~mcpo_megatron.models.routing_replay`.
        sequence_packing: micro-batches are token-budget bins of whole sequences in megatron's THD form
            (:mod:`~mcpo_megatron.models.packing`) instead of padded rectangles; same results and gradients.
    """

    dtype: torch.dtype | str | None = None
    optim: OptimSettings = dataclasses.field(default_factory=OptimSettings)
    max_tokens_per_microbatch: int = 8192
    logprob_chunk_size: int = 4096
    temperature: float = 1.0
    transformer_impl: str = "auto"
    sequence_parallel: bool = False
    recompute_activations: bool = False
    moe_aux_loss_coeff: float = 0.0
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    moe_routing_replay: str = "off"
    sequence_packing: bool = False

    def __post_init__(self) -> None:
        # the resolved dtype, so that the policy and its reference read one value
        object.__setattr__(self, "dtype", as_dtype(self.dtype))
        if not self.temperature > 0:
            raise ValueError(f"PolicySettings: temperature={self.temperature!r} must be > 0 (logits are divided by it)")
        if not self.moe_aux_loss_coeff >= 0:
            raise ValueError(f"PolicySettings: moe_aux_loss_coeff={self.moe_aux_loss_coeff!r} must be >= 0")
        budget = self.max_tokens_per_microbatch
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
            raise ValueError(f"PolicySettings: max_tokens_per_microbatch={budget!r} must be a positive integer")
        if not isinstance(self.logprob_chunk_size, int) or self.logprob_chunk_size < 1:
            raise ValueError(
                f"PolicySettings: logprob_chunk_size={self.logprob_chunk_size!r} must be a positive integer")
        if self.moe_routing_replay not in ROUTING_REPLAY_MODES:
            raise ValueError(f"PolicySettings: moe_routing_replay={self.moe_routing_replay!r} must be one of "
                             f"{list(ROUTING_REPLAY_MODES)}")
        if self.sequence_packing and self.moe_routing_replay != "off":
            raise ValueError(f"PolicySettings: sequence_packing=True with moe_routing_replay="
                             f"{self.moe_routing_replay!r}: routing replay reads padded micro-batches; set one of "
                             "them off")
        if self.overlap_param_gather and not self.optim.use_distributed_optimizer:
            raise ValueError("PolicySettings: overlap_param_gather=True needs the distributed optimizer "
                             "(OptimSettings(use_distributed_optimizer=True)), whose all-gather it overlaps")
