"""The trainer's loss function reads each algorithm setting from its own key."""

from types import SimpleNamespace

import pytest
import torch

from mcpo_megatron.algorithms import LossInputs, LossSettings, policy_loss
from mcpo_megatron.config import load_config
from mcpo_megatron.trainer.loop import make_loss_fn

BASE = ["data.train_batch_size=4", "algorithm.mini_batch_size=2", "rollout.n=4", "reward.overlong_buffer.enable=false"]


def _mb():
    """One micro-batch of two sequences whose log-ratios d = logp - old reach |d| = 2."""
    d = torch.tensor([[0.3, -2.0, 1.5], [2.0, -0.4, 0.1]])
    old = torch.full((2, 3), -1.0)
    w = torch.full((2, 3), 1.0 / 6)
    fields = {"old_logp": old, "advantages": torch.tensor([[1.0] * 3, [-1.0] * 3]), "pg_weight": w,
              "hkl_weight": w, "rollout_logp": old - 0.2}
    return SimpleNamespace(token_fields=fields, mask=torch.ones(2, 3, dtype=torch.bool)), old + d


def _loss_and_grad(cfg):
    mb, logp = _mb()
    logp = logp.clone().requires_grad_(True)
    loss, sums = make_loss_fn(cfg)(logp, None, mb)
    loss.backward()
    return loss.item(), logp.grad, sums


def test_hinge_clamp_leaves_the_pg_ratio_alone():
    """DAPO has no hinge: the hinge's d_clamp must not change its PPO ratio."""
    default = _loss_and_grad(load_config(None, BASE + ["algorithm.name=dapo"]))
    hinge_key = _loss_and_grad(load_config(None, BASE + ["algorithm.name=dapo", "algorithm.mcpo.hinge_kl.d_clamp=0.5"]))
    assert hinge_key[0] == default[0]
    torch.testing.assert_close(hinge_key[1], default[1], rtol=0, atol=0)


@pytest.mark.parametrize("name", ["dapo", "mcpo"])
def test_log_ratio_clamp_bounds_the_pg_ratio(name):
    cfg = load_config(None, BASE + [f"algorithm.name={name}", "algorithm.log_ratio_clamp=0.5"])
    loss, grad, _ = _loss_and_grad(cfg)
    mb, logp = _mb()
    f = mb.token_fields
    want_logp = logp.clone().requires_grad_(True)
    hinge = cfg.algorithm.mcpo.hinge_kl.enable
    want, _ = policy_loss(LossInputs(want_logp, f["old_logp"], f["advantages"], f["pg_weight"], mb.mask,
                                     hkl_weight=f["hkl_weight"] if hinge else None),
                          LossSettings(clip_low=0.2, clip_high=0.28, log_ratio_clamp=0.5, d_clamp=20.0))
    want.backward()
    assert loss == pytest.approx(want.item(), rel=1e-6)
    torch.testing.assert_close(grad, want_logp.grad)
    # |d| = 2 > 0.5 saturates the ratio there: no PG gradient on those tokens
    if not hinge:
        assert grad[0, 1] == 0 and grad[0, 2] == 0 and grad[1, 0] == 0


@pytest.mark.parametrize("kl_type", ["k1", "k2", "k3"])
def test_reference_kl_enters_the_loss(kl_type):
    """algorithm.kl.enable adds kl_coef x the reference KL of the frozen policy's log-probs (token field ref_logp)."""
    cfg = load_config(None, BASE + ["algorithm.name=grpo", "algorithm.kl.enable=true", "algorithm.kl.coef=0.2",
                                    f"algorithm.kl.type={kl_type}"])
    mb, logp = _mb()
    f = mb.token_fields
    f["ref_logp"] = logp.detach() + torch.tensor([[0.5, -0.3, 0.0], [1.0, 0.2, -0.7]])
    got_logp = logp.clone().requires_grad_(True)
    loss, sums = make_loss_fn(cfg)(got_logp, None, mb)
    loss.backward()
    want_logp = logp.clone().requires_grad_(True)
    want, want_sums = policy_loss(LossInputs(want_logp, f["old_logp"], f["advantages"], f["pg_weight"], mb.mask,
                                             ref_logp=f["ref_logp"]),
                                  LossSettings(clip_low=0.2, clip_high=0.2, kl_coef=0.2, kl_type=kl_type))
    want.backward()
    assert float(sums["kl_loss"]) != 0 and float(sums["kl_loss"]) == pytest.approx(float(want_sums["kl_loss"]))
    assert loss.item() == pytest.approx(want.item(), rel=1e-6)
    torch.testing.assert_close(got_logp.grad, want_logp.grad)
    # off (the presets' default): no reference needed, no KL term
    off = load_config(None, BASE + ["algorithm.name=grpo"])
    assert "kl_loss" not in make_loss_fn(off)(logp.clone().requires_grad_(True), None, mb)[1]
