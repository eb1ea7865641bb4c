"""Optimizer and learning-rate schedule for the Megatron policy.

A thin layer over megatron-core: :func:`build_optimizer` fills an ``OptimizerConfig`` and
calls ``get_megatron_optimizer`` (Adam; the distributed optimizer shards fp32 master
weights and Adam moments over DP; gradient clipping by global norm inside ``step()``;
weight decay skips biases and 1-D parameters, megatron's default).  On a CPU torch
megatron falls back to ``torch.optim.AdamW``.  :func:`build_scheduler` wraps
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

_DECAY_STYLES = ("constant", "linear", "cosine")
_NO_CLIP = 1.0e30


@dataclass
class OptimSettings:
    """What the policy needs to know about the optimizer (mirrors ``config.optimizer``)."""

    lr: float = 1.0e-6
    min_lr: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1.0e-8
    clip_grad: float = 1.0
    lr_warmup_steps: int = 0
    lr_decay_style: str = "constant"
    lr_decay_steps: int | None = None
    use_distributed_optimizer: bool = True

    def validate(self) -> None:
        """Raise ``ValueError`` naming the setting, the value and the rule (the config's optimizer section is
        checked by the schema, under its own keys, before anything is built)."""
        if not self.lr > 0:
            raise ValueError(f"OptimSettings: lr={self.lr!r} must be > 0")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"OptimSettings: min_lr={self.min_lr!r} must be in [0, lr={self.lr}]")
        if self.weight_decay < 0:
            raise ValueError(f"OptimSettings: weight_decay={self.weight_decay!r} must be >= 0")
        if self.clip_grad < 0:
            raise ValueError(f"OptimSettings: clip_grad={self.clip_grad!r} must be >= 0 (0 disables clipping)")
        if self.lr_warmup_steps < 0:
            raise ValueError(f"OptimSettings: lr_warmup_steps={self.lr_warmup_steps!r} must be >= 0")
        if self.lr_decay_style not in _DECAY_STYLES:
            raise ValueError(f"OptimSettings: lr_decay_style={self.lr_decay_style!r} must be one of {_DECAY_STYLES}")
        if self.lr_decay_style != "constant" and (
            self.lr_decay_steps is None or self.lr_decay_steps <= self.lr_warmup_steps
        ):
            raise ValueError(
                f"OptimSettings: lr_decay_steps={self.lr_decay_steps!r} must be set and > lr_warmup_steps="
                f"{self.lr_warmup_steps} for lr_decay_style={self.lr_decay_style!r}"
            )

    @classmethod
    def from_config(cls, opt: Any, **overrides) -> "OptimSettings":
        """Build from a ``config.optimizer`` section (attribute or mapping access).

        Known keys: lr, min_lr, weight_decay, betas / adam_beta1 / adam_beta2, eps / adam_eps,
        grad_clip / clip_grad, lr_warmup_steps, lr_schedule / lr_decay_style, lr_decay_steps,
        use_distributed_optimizer.  Missing keys keep their defaults.
        """
        def get(key: str):
            try:
                return opt.get(key, None) if hasattr(opt, "get") else getattr(opt, key, None)
            except Exception:  # a structured OmegaConf section without that key
                return None

        kw: dict[str, Any] = {}
        if get("lr_schedule") is not None:
            kw["lr_decay_style"] = get("lr_schedule")
        for key in ("lr", "min_lr", "weight_decay", "lr_warmup_steps", "lr_decay_style",
                    "lr_decay_steps", "use_distributed_optimizer", "adam_beta1", "adam_beta2", "adam_eps"):
            if get(key) is not None:
                kw[key] = get(key)
        if get("betas") is not None:
            kw["adam_beta1"], kw["adam_beta2"] = (float(b) for b in get("betas"))
        if get("eps") is not None:
            kw["adam_eps"] = float(get("eps"))
        for key in ("grad_clip", "clip_grad"):
            if get(key) is not None:
                kw["clip_grad"] = float(get(key))
        kw.update(overrides)
        return cls(**kw)


def make_optimizer_config(settings: OptimSettings, *, bf16: bool):
    """megatron-core ``OptimizerConfig`` for Adam with these settings."""
    from megatron.core.optimizer import OptimizerConfig

    settings.validate()
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

    settings.validate()
    warmup = int(settings.lr_warmup_steps)
    if settings.lr_decay_style == "constant":
        decay_steps = max(warmup + 1, int(settings.lr_decay_steps or 0))
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
