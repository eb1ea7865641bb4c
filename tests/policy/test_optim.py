"""Optimizer settings and the LR schedule (single process; closed-form expectations)."""

import math
import re

import pytest
import torch

from mcpo_megatron.models.optim import OptimSettings, build_scheduler, make_optimizer_config


def _lrs(settings: OptimSettings, steps: int) -> list[float]:
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=settings.lr)
    sched = build_scheduler(opt, settings)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        sched.step(increment=1)
    return out


def test_warmup_then_cosine_to_min_lr():
    s = OptimSettings(lr=1e-3, min_lr=1e-4, lr_warmup_steps=4, lr_decay_style="cosine", lr_decay_steps=10)
    lrs = _lrs(s, 13)
    for k, lr in enumerate(lrs):
        if k <= 4:
            want = 1e-3 * k / 4
        elif k <= 10:
            want = 1e-4 + 0.9e-3 * 0.5 * (1 + math.cos(math.pi * (k - 4) / 6))
        else:
            want = 1e-4
        assert lr == pytest.approx(want, rel=1e-12, abs=1e-15), k


def test_linear_decay_and_constant():
    lin = _lrs(OptimSettings(lr=2e-3, min_lr=0.0, lr_decay_style="linear", lr_decay_steps=4), 6)
    assert lin == pytest.approx([2e-3, 1.5e-3, 1e-3, 0.5e-3, 0.0, 0.0], abs=1e-15)
    const = _lrs(OptimSettings(lr=1e-6, lr_warmup_steps=2), 5)
    assert const == pytest.approx([0.0, 0.5e-6, 1e-6, 1e-6, 1e-6], abs=1e-18)


def test_from_config_maps_project_keys():
    from mcpo_megatron.config import OptimizerConfig

    cfg = OptimizerConfig(lr=3e-6, weight_decay=0.05, grad_clip=0.7, adam_beta2=0.95, lr_warmup_steps=3,
                          lr_schedule="cosine")
    s = OptimSettings.from_config(cfg, lr_decay_steps=50, use_distributed_optimizer=False)
    assert (s.lr, s.weight_decay, s.clip_grad, s.adam_beta2, s.lr_warmup_steps, s.lr_decay_style,
            s.lr_decay_steps, s.use_distributed_optimizer) == (3e-6, 0.05, 0.7, 0.95, 3, "cosine", 50, False)
    mc = make_optimizer_config(s, bf16=True)
    assert (mc.optimizer, mc.lr, mc.clip_grad, mc.bf16, mc.params_dtype) == ("adam", 3e-6, 0.7, True, torch.bfloat16)


@pytest.mark.parametrize(
    "kwargs, key",
    [(dict(lr=0.0), "lr=0.0"), (dict(min_lr=1.0), "min_lr=1.0"),
     (dict(lr_decay_style="cosine"), "lr_decay_steps=None"),
     (dict(lr_decay_style="step"), "lr_decay_style='step'"), (dict(clip_grad=-1.0), "clip_grad=-1.0")],
)
def test_bad_settings_name_the_setting(kwargs, key):
    """The settings' own names (the config keys are the schema's to name: optimizer.lr_schedule, ...)."""
    with pytest.raises(ValueError, match=f"OptimSettings: {re.escape(key)} must"):
        OptimSettings(**kwargs).validate()
