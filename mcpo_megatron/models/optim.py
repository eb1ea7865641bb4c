"""Optimizer and learning-rate schedule for the Megatron policy.

A thin layer over megatron-core: :func:`build_optimizer` fills an ``OptimizerConfig`` and
calls ``get_megatron_optimizer`` (Adam; the distributed optimizer shards fp32 master
weights and Adam moments over DP; gradient clipping by global norm inside ``step()``;
weight decay skips biases and 1-D parameters, megatron's default).  Without Transformer
Engine's or Apex's FusedAdam (on a CPU, and on a GPU without them) megatron runs
``torch.optim.AdamW``, whose step a checkpoint load gets wrong; the policy's load repairs it
(``mcore_compat.restore_adam_steps``).  :func:`build_scheduler` wraps
``OptimizerParamScheduler``: linear warm-up to ``lr``, then constant, cosine or linear
decay to ``min_lr``.

Warm-up follows megatron's convention: optimizer step k (0-based) uses
``lr * k / lr_warmup_steps`` while k < lr_warmup_steps, so the first step of a warm-up
moves nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

_NO_CLIP = 1.0e30


@dataclass
class OptimSettings:
    """The policy's Adam and LR schedule under megatron-core's names: the fields of its ``OptimizerConfig`` this
    project sets (the dtype fields follow the policy's parameters) and the schedule arguments of its
    ``OptimizerParamScheduler``.

    Nothing is checked here: a run's settings come from a validated config (:meth:`from_config`; the schema owns
    the rules and names the config's keys), and megatron-core asserts its own bounds.
    """

    lr: float = 1.0e-6
    min_lr: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1.0e-8
    clip_grad: float = 1.0                        # global-norm bound; 0: no clipping (the norm is still logged)
    use_distributed_optimizer: bool = True
    lr_warmup_steps: int = 0
    lr_decay_style: str = "constant"              # constant | linear | cosine
    lr_decay_steps: int | None = None             # the optimizer step the decay ends at (linear and cosine)

    @classmethod
    def from_config(cls, cfg: Any, *, optimizer_steps: int) -> "OptimSettings":
        """The settings of a run's config: ``optimizer.*`` under megatron's names (``grad_clip`` is ``clip_grad``,
        ``lr_schedule`` is ``lr_decay_style``) and ``parallelism.use_distributed_optimizer``. A decaying schedule
        decays over the run's ``optimizer_steps``."""
        o = cfg.optimizer
        decays = o.lr_schedule != "constant"
        return cls(lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay, adam_beta1=o.adam_beta1,
                   adam_beta2=o.adam_beta2, adam_eps=o.adam_eps, clip_grad=o.grad_clip,
                   use_distributed_optimizer=cfg.parallelism.use_distributed_optimizer,
                   lr_warmup_steps=o.lr_warmup_steps, lr_decay_style=o.lr_schedule,
                   lr_decay_steps=optimizer_steps if decays else None)


def make_optimizer_config(settings: OptimSettings, *, bf16: bool):
    """megatron-core ``OptimizerConfig`` for Adam with these settings."""
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(
        optimizer="adam",
        lr=settings.lr,
        min_lr=settings.min_lr,
        weight_decay=settings.weight_decay,
        adam_beta1=settings.adam_beta1,
        adam_beta2=settings.adam_beta2,
        adam_eps=settings.adam_eps,
        # megatron only measures the grad norm when clipping is on; "off" becomes a bound
        # no norm reaches, so the norm is still computed and logged.
        clip_grad=settings.clip_grad if settings.clip_grad > 0 else _NO_CLIP,
        bf16=bf16,
        fp16=False,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_distributed_optimizer=settings.use_distributed_optimizer,
    )


def build_optimizer(model_chunks: list, settings: OptimSettings, *, bf16: bool):
    """``get_megatron_optimizer`` over DDP-wrapped ``model_chunks``."""
    from megatron.core.optimizer import get_megatron_optimizer

    return get_megatron_optimizer(make_optimizer_config(settings, bf16=bf16), model_chunks)


def build_scheduler(optimizer, settings: OptimSettings):
    """``OptimizerParamScheduler``: warm-up, then constant / linear / cosine decay to min_lr.

    Weight decay stays constant.  The scheduler's own state is checkpointed (its
    ``state_dict``), and on load the checkpoint's values win.
    """
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    warmup = int(settings.lr_warmup_steps)
    if settings.lr_decay_style == "constant":
        decay_steps = max(warmup + 1, int(settings.lr_decay_steps or 0))  # megatron wants warm-up < decay steps
    elif settings.lr_decay_steps is None:
        raise ValueError(f"build_scheduler: lr_decay_style={settings.lr_decay_style!r} needs lr_decay_steps, the "
                         "optimizer step its decay ends at")
    else:
        decay_steps = int(settings.lr_decay_steps)
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if warmup > 0 else settings.lr,
        max_lr=settings.lr,
        min_lr=settings.min_lr if settings.lr_decay_style != "constant" else settings.lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=decay_steps,
        lr_decay_style=settings.lr_decay_style,
        start_wd=settings.weight_decay,
        end_wd=settings.weight_decay,
        wd_incr_steps=1,
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=True,
        override_opt_param_scheduler=False,
    )
