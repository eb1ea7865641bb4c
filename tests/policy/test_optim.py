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


def test_from_config_maps_the_config_keys_to_megatrons_names():
    from mcpo_megatron.config import load_config

    cfg = load_config(None, ["optimizer.lr=3e-6", "optimizer.weight_decay=0.05", "optimizer.grad_clip=0.7",
                             "optimizer.adam_beta2=0.95", "optimizer.lr_warmup_steps=3", "optimizer.lr_schedule=cosine",
                             "parallelism.use_distributed_optimizer=false"])
    s = OptimSettings.from_config(cfg, optimizer_steps=50)
    assert (s.lr, s.weight_decay, s.clip_grad, s.adam_beta2, s.lr_warmup_steps, s.lr_decay_style,
            s.lr_decay_steps, s.use_distributed_optimizer) == (3e-6, 0.05, 0.7, 0.95, 3, "cosine", 50, False)
    mc = make_optimizer_config(s, bf16=True)
    assert (mc.optimizer, mc.lr, mc.clip_grad, mc.bf16, mc.params_dtype) == ("adam", 3e-6, 0.7, True, torch.bfloat16)
    constant = OptimSettings.from_config(load_config(), optimizer_steps=50)
    assert (constant.lr_decay_style, constant.lr_decay_steps, constant.use_distributed_optimizer) == \
        ("constant", None, True)


def test_a_decaying_schedule_without_its_length_names_the_setting():
    """The scheduler's own names (the config's rules, under its keys, are the schema's: tests/config)."""
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)
    with pytest.raises(ValueError, match=re.escape("build_scheduler: lr_decay_style='cosine' needs lr_decay_steps")):
        build_scheduler(opt, OptimSettings(lr_decay_style="cosine"))
