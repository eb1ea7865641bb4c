"""The training run around the algorithm: ``optimizer`` (megatron's Adam and LR schedule), ``trainer`` (steps,
budgets, staleness), ``checkpoint``, ``logging`` and ``diagnostics``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from mcpo_megatron.config.checks import Checks, at_least, choice


@dataclass
class OptimizerConfig:
    """megatron-core's Adam and LR schedule (models/optim.py's ``OptimSettings.from_config`` maps these keys onto
    megatron's names, the only two that differ being ``grad_clip`` and ``lr_schedule``)."""
    lr: float = 1.0e-6
    min_lr: float = 0.0
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1.0e-8
    grad_clip: float = 1.0                        # megatron's clip_grad: global-norm bound, 0: no clipping
    lr_warmup_steps: int = at_least(0, 0)
    lr_schedule: str = choice("constant", "cosine", "linear")  # megatron's lr_decay_style (over the whole run)

    def check(self, c: Checks) -> None:
        if not self.lr > 0:
            c.error("optimizer.lr", self.lr, "must be > 0", "use e.g. 1e-6")
        if not 0 <= self.min_lr <= self.lr:
            c.error("optimizer.min_lr", self.min_lr, f"must satisfy 0 <= min_lr <= lr={self.lr}", "use 0")
        for key, value in (("optimizer.adam_beta1", self.adam_beta1), ("optimizer.adam_beta2", self.adam_beta2)):
            if not 0 <= value < 1:
                c.error(key, value, "must satisfy 0 <= beta < 1", "use 0.9 / 0.999")
        for key, value in (("optimizer.weight_decay", self.weight_decay), ("optimizer.grad_clip", self.grad_clip)):
            if value < 0:
                c.error(key, value, "must be >= 0", "use 0 to disable")
        if not self.adam_eps > 0:
            c.error("optimizer.adam_eps", self.adam_eps, "must be > 0", "use 1e-8")
        self._check_warmup_ends(c)

    def _check_warmup_ends(self, c: Checks) -> None:
        """A decaying schedule decays over the run's optimizer steps, after the warm-up: it needs some left."""
        d, total_steps = c.derived, c.cfg.trainer.total_steps
        if self.lr_schedule == "constant" or d is None or d.optimizer_steps_per_global_step < 1:
            return
        optimizer_steps = total_steps * d.optimizer_steps_per_global_step
        if self.lr_warmup_steps >= optimizer_steps:
            c.error("optimizer.lr_warmup_steps", self.lr_warmup_steps,
                    f"must be < the run's {optimizer_steps} optimizer steps (trainer.total_steps={total_steps} x "
                    f"{d.optimizer_steps_per_global_step} per step) for optimizer.lr_schedule={self.lr_schedule} "
                    "to decay", "lower optimizer.lr_warmup_steps, raise trainer.total_steps or use "
                    "optimizer.lr_schedule=constant")

# The parts of the training state trainer.offload can move, each a boolean key of OffloadConfig.
OFFLOAD_PARTS = ("buffers", "master_weights", "moments", "reference")


@dataclass
class OffloadConfig:
    """``trainer.offload``: what leaves the GPU between a step's last update and the next step's old-log-prob
    pass, while a colocated engine generates (models/offload.py moves it; ``mcpo plan`` sizes both phases)."""
    # null: on with GPUs and colocated engines that sleep (the engine takes the memory), off on CPU (nothing to
    # gain) and with rollout.placement=separate (no engine shares the training GPUs); true / false force it.
    enable: Optional[bool] = None
    buffers: bool = True          # megatron DDP's parameter (model dtype) and gradient (fp32) buffers
    master_weights: bool = True   # the distributed optimizer's fp32 master weights (bf16 models)
    moments: bool = True          # Adam's exp_avg and exp_avg_sq (fp32)
    reference: bool = True        # algorithm.kl's frozen reference policy

    def check(self, c: Checks) -> None:
        r = c.cfg.rollout
        if self.enable and r.placement == "separate":
            c.error("trainer.offload.enable", self.enable, "with rollout.placement=separate no engine shares the "
                    "training GPUs, so nothing would use the memory offloading frees",
                    "set trainer.offload.enable=null (or false)")
        if self.enable and r.engine == "vllm" and not r.enable_sleep_mode:
            c.error("trainer.offload.enable", self.enable, "needs rollout.enable_sleep_mode=true: the colocated "
                    "engine must release its memory for the training state to come back",
                    "set rollout.enable_sleep_mode=true, or trainer.offload.enable=null")
        if self.enable and not any(getattr(self, k) for k in OFFLOAD_PARTS):
            c.warn("trainer.offload.enable=true with every part false (buffers, master_weights, moments, "
                   "reference): nothing is offloaded")


def offload_enabled(cfg, *, cuda: bool) -> bool:
    """What ``trainer.offload.enable`` resolves to on a machine with (``cuda``) or without GPUs; ``cfg`` is a
    config object or nested mappings (absent keys take their defaults)."""
    def get(dotted: str, default):
        node = cfg
        for part in dotted.split("."):
            node = node.get(part) if hasattr(node, "get") else getattr(node, part, None)
            if node is None:
                return default
        return node

    enable = get("trainer.offload.enable", None)
    if enable is not None:
        return bool(enable)
    return bool(cuda and get("rollout.placement", "colocated") == "colocated"
                and (get("rollout.engine", "torch") != "vllm" or get("rollout.enable_sleep_mode", True)))


@dataclass
class TrainerConfig:
    total_steps: int = at_least(100, 1)
    seed: int = 0
    output_dir: str = "runs/default"
    resume: str = "auto"                          # auto | never | <checkpoint path>
    # resume=never into an output_dir (or checkpoint.dir) that holds a run is refused; true moves that run aside
    # to <dir>.replaced-<YYYYmmdd-HHMMSS> first (nothing is deleted). See trainer/run_dir.py.
    overwrite: bool = False
    max_tokens_per_microbatch: int = at_least(16384, 1)
    # Micro-batches as token-budget bins of whole sequences in megatron's packed (THD) form instead of padded
    # rectangles (models/packing.py): no padding compute; the same log-probs, loss and gradients.
    sequence_packing: bool = False
    # What the data-parallel ranks' shares balance (Karmarkar-Karp): tokens, or estimated FLOPs (attention grows
    # with the square of a sequence's length). Read with sequence_packing=true.
    packing_balance: str = choice("tokens", "flops")
    logprob_chunk_size: int = at_least(4096, 1)
    log_every: int = at_least(1, 1)
    # Asynchronous RL (docs/algorithms.md §13): how many global steps the policy that generated a trained sample may lag
    # the trainer's (with rollout.partial: the oldest token of a trained response). 0 = synchronous; 1 = the next
    # step's generation overlaps this step's training. > 0 needs rollout.placement=separate or rollout.partial.
    max_staleness: int = at_least(0, 0)
    # rollout.partial: a response whose oldest token would exceed max_staleness is waited for (its step's
    # generation goes on until its group is complete, so it trains just within the bound) or dropped (its tokens
    # are discarded and it is generated again from its prompt; counted in partial/dropped_sequences).
    staleness_policy: str = choice("wait", "drop")
    offload: OffloadConfig = field(default_factory=OffloadConfig)

    def check(self, c: Checks) -> None:
        if self.max_staleness > 0 and c.cfg.rollout.placement != "separate" and not c.cfg.rollout.partial.enable:
            c.error("trainer.max_staleness", self.max_staleness,
                    "generation overlaps training only when the engines have ranks of their own, and a response "
                    "carries over to a later step only with partial rollouts",
                    "set rollout.placement=separate and rollout.ranks, or rollout.partial.enable=true, or "
                    "trainer.max_staleness=0")
        if self.max_staleness > 0 and c.cfg.algorithm.tis.enable is False:
            c.warn(f"trainer.max_staleness={self.max_staleness} with algorithm.tis.enable=false: samples from an "
                   "older policy are not reweighted (decoupled PPO's behaviour weight); NeMo-RL reports collapse "
                   "after a few hundred steps without it")
        if self.sequence_packing and c.cfg.model.moe_routing_replay != "off":
            c.error("trainer.sequence_packing", True,
                    f"routing replay (model.moe_routing_replay={c.cfg.model.moe_routing_replay}) reads padded "
                    "micro-batches, not packed ones", "set trainer.sequence_packing=false or "
                    "model.moe_routing_replay=off")
        longest = c.cfg.data.max_prompt_length + c.cfg.data.max_response_length
        if self.max_tokens_per_microbatch < longest:
            c.warn(f"trainer.max_tokens_per_microbatch={self.max_tokens_per_microbatch} is below the longest "
                   f"possible sequence (max_prompt_length + max_response_length = {longest}); such a sequence "
                   f"exceeds the token budget of a micro-batch. Raise trainer.max_tokens_per_microbatch to at "
                   f"least that.")


@dataclass
class CheckpointConfig:
    interval: int = at_least(50, 0)               # 0 = only at the end and on signal
    keep_last: int = at_least(2, 1)               # complete checkpoints kept (the newest is the resume point)
    save_on_signal: bool = True
    dir: Optional[str] = None                     # null -> <trainer.output_dir>/checkpoints


@dataclass
class WandbConfig:
    enable: bool = False
    project: str = "mcpo-megatron"
    name: Optional[str] = None
    entity: Optional[str] = None


@dataclass
class LoggingConfig:
    jsonl: bool = True
    tensorboard: bool = True
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class DiagnosticsConfig:
    retention_probe: bool = False                 # extra rollouts on last step's mastered prompts (no gradient)
    retention_probe_n: int = at_least(4, 1)
