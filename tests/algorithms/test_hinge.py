"""Hinge-KL phi of Eq. (10) as both implementations of the loss compute it (A = 0 on a mastered sequence: the hinge
alone): the test vectors of docs/algorithms.md §6, kinks, gradcheck, overflow safety, against the loop reference."""

import math

import pytest
import torch

from mcpo_megatron.algorithms import LossInputs, LossSettings, token_weights

from algo_reference import phi as ref_phi

F64 = torch.float64
DELTA = 0.01

# docs/algorithms.md §6 table: d -> (phi, phi')
TABLE = [
    (0.0, 0.0, 0.0),
    (0.005, 0.0, 0.0),
    (0.02, 1.5117294259e-4, 2.0201340027e-2),
    (-0.02, 1.4883955759e-4, -1.9801326693e-2),
    (0.1, 5.1207509915e-3, 1.0517091808e-1),
    (-0.1, 4.7875842868e-3, -9.5162581964e-2),
    (1.0, 7.1823166137e-1, 1.7182818285),
]


def _phi_and_grad(loss_fn, d_values, dtype=F64):
    """phi and phi' through ``loss_fn``: one mastered sequence holding the d values, A = 0 (hinge only)."""
    n = len(d_values)
    logp = torch.tensor([d_values], dtype=dtype, requires_grad=True)
    old = torch.zeros(1, n, dtype=dtype)
    mask = torch.ones(1, n, dtype=torch.bool)
    pg_w, hk_w = token_weights(mask, torch.tensor([True]), loss_agg_mode="seq-mean-token-mean",
                               global_counts=(n, 1, 1), dtype=dtype)
    loss, sums = loss_fn(LossInputs(logp, old, torch.zeros(1, dtype=dtype), pg_w, mask, hkl_weight=hk_w))
    loss.backward()
    return loss, logp.grad[0] * n, sums


def test_constants_c_plus_minus():
    assert math.exp(DELTA) - DELTA - 1 == pytest.approx(5.016708416806e-5, rel=1e-11)
    assert math.exp(-DELTA) + DELTA - 1 == pytest.approx(4.983374916805e-5, rel=1e-11)


def _phi_each(loss_fn, d_values, dtype=F64):
    """phi(d) and phi'(d) of each value alone (a one-token mastered sequence per call)."""
    out = [_phi_and_grad(loss_fn, [d], dtype) for d in d_values]
    return [loss.item() for loss, _, _ in out], [g[0].item() for _, g, _ in out]


@pytest.mark.parametrize("d, phi, dphi", TABLE)
def test_phi_table_one_token(loss_fn, d, phi, dphi):
    [val], [grad] = _phi_each(loss_fn, [d])
    assert val == pytest.approx(phi, rel=1e-9, abs=1e-15)
    assert grad == pytest.approx(dphi, rel=1e-9, abs=1e-15)
    # and the literal definition of Eq. (10)
    assert float(ref_phi(torch.tensor(d, dtype=F64), DELTA)) == pytest.approx(phi, rel=1e-9, abs=1e-15)


def test_phi_table_whole_sequence(loss_fn):
    ds = [row[0] for row in TABLE]
    _, grads, _ = _phi_and_grad(loss_fn, ds)
    for (d, phi, dphi), g in zip(TABLE, grads.tolist()):
        assert g == pytest.approx(dphi, rel=1e-9, abs=1e-15), d
    # value: mean of phi over the sequence
    loss, _, _ = _phi_and_grad(loss_fn, ds)
    assert loss.item() == pytest.approx(sum(r[1] for r in TABLE) / len(TABLE), rel=1e-9)


def test_one_mastered_sequence_documented_vector(loss_fn):
    loss, grads_times_n, sums = _phi_and_grad(loss_fn, [0.0, 0.005, 0.02, -0.02])
    assert loss.item() == pytest.approx(7.500312504e-5, rel=1e-9)
    grads = (grads_times_n / 4).tolist()
    expected = [0.0, 0.0, 5.0503350e-3, -4.9503317e-3]
    for g, e in zip(grads, expected):
        assert g == pytest.approx(e, rel=1e-7, abs=0.0)
    assert grads[0] == 0.0 and grads[1] == 0.0
    assert float(sums["hinge_active"]) == 2 and float(sums["hinge_tokens"]) == 4


def test_identical_logp_gives_zero_loss_and_gradient(loss_fn):
    torch.manual_seed(1)
    old = -torch.rand(3, 5, dtype=F64)
    x = old.clone().requires_grad_(True)
    mask = torch.ones(3, 5, dtype=torch.bool)
    pg_w, hk_w = token_weights(mask, torch.ones(3, dtype=torch.bool), loss_agg_mode="token-mean",
                               global_counts=(15, 3, 3), dtype=F64)
    loss, sums = loss_fn(LossInputs(x, old, torch.zeros(3, dtype=F64), pg_w, mask, hkl_weight=hk_w))
    loss.backward()
    assert loss.item() == 0.0 and float(sums["hinge_value"]) == 0.0
    assert torch.count_nonzero(x.grad) == 0
    loss, grads, _ = _phi_and_grad(loss_fn, [0.0] * 6)
    assert loss.item() == 0.0 and torch.count_nonzero(grads) == 0


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_exact_gradient_on_both_sides_of_each_kink(loss_fn, sign):
    eps = 1e-7
    inside, outside = sign * (DELTA - eps), sign * (DELTA + eps)
    _, gr, _ = _phi_and_grad(loss_fn, [inside, outside])
    g = gr.tolist()
    assert g[0] == 0.0
    assert g[1] == pytest.approx(math.expm1(outside), rel=1e-12)
    # the jump of the derivative at the kink: 0 -> e^{+-delta} - 1
    assert math.expm1(sign * DELTA) == pytest.approx(0.0100502 if sign > 0 else -0.0099502, rel=1e-5)


def test_value_is_continuous_at_the_kinks(loss_fn):
    values, _ = _phi_each(loss_fn, [d + eps for d in (DELTA, -DELTA) for eps in (1e-9, -1e-9)])
    assert all(abs(v) < 2e-10 for v in values), values


def test_gradcheck_hinge_alone_away_from_the_kinks(loss_fn):
    d = torch.tensor([[-0.5, -0.05, -0.003, 0.0, 0.004, 0.03, 0.2, 1.5]], dtype=F64, requires_grad=True)
    old = torch.zeros_like(d)
    mask = torch.ones(1, 8, dtype=torch.bool)
    pg_w, hk_w = token_weights(mask, torch.tensor([True]), loss_agg_mode="token-mean",
                               global_counts=(8, 1, 1), dtype=F64)
    zero = torch.zeros(1, dtype=F64)
    assert torch.autograd.gradcheck(lambda x: loss_fn(LossInputs(x, old, zero, pg_w, mask, hkl_weight=hk_w))[0], (d,),
                                    eps=1e-6, atol=1e-9)


def test_gradcheck_loss_with_hinge(loss_fn):
    torch.manual_seed(0)
    B, T = 3, 5
    old = -torch.rand(B, T, dtype=F64)
    # drifts away from +-delta and from the clip bounds
    d = torch.tensor([[0.03, -0.02, 0.005, 0.1, -0.3],
                      [0.0, 0.5, -0.04, 0.02, 0.001],
                      [-0.06, 0.07, 0.002, -0.002, 0.15]], dtype=F64)
    logp = (old + d).requires_grad_(True)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[2, 4] = False
    mastered = torch.tensor([True, False, True])
    pg_w, hk_w = token_weights(mask, mastered, loss_agg_mode="seq-mean-token-mean", global_counts=(14, 3, 2), dtype=F64)
    adv = torch.tensor([0.7, -1.3, 0.0], dtype=F64)

    def f(x):
        return loss_fn(LossInputs(x, old, adv, pg_w, mask, hkl_weight=hk_w), LossSettings(clip_high=0.28))[0]

    assert torch.autograd.gradcheck(f, (logp,), eps=1e-7, atol=1e-8)


def test_float32_stable_form_matches_float64(loss_fn):
    # in fp32 at d = 0.0105 the naive exp(d) - d - 1 form gives 5.1460e-6; exact 5.15136e-6
    x32 = torch.tensor(0.0105, dtype=torch.float32)
    exact = float(ref_phi(torch.tensor(float(x32), dtype=F64), DELTA))
    assert exact == pytest.approx(5.15136e-6, rel=2e-4)
    loss32, _, _ = _phi_and_grad(loss_fn, [float(x32)], dtype=torch.float32)
    assert loss32.dtype == torch.float32
    assert loss32.item() == pytest.approx(exact, rel=1e-4)
    naive = float(torch.exp(x32) - x32 - 1) - (math.exp(DELTA) - DELTA - 1)
    assert abs(naive - exact) > 10 * abs(loss32.item() - exact)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_overflowing_drift_keeps_gradients_finite(loss_fn, dtype):
    # |d| far beyond the clamp: exp(1000) overflows if any branch evaluated it unclamped
    d = torch.tensor([[1000.0, -1000.0, 50.0, 0.5]], dtype=dtype)
    logp = d.clone().requires_grad_(True)
    mask = torch.ones(1, 4, dtype=torch.bool)
    pg_w, hk_w = token_weights(mask, torch.tensor([True]), loss_agg_mode="token-mean",
                               global_counts=(4, 1, 1), dtype=dtype)
    # the hinge alone (A = 0): weight 1/4 per token
    val, _ = loss_fn(LossInputs(logp, torch.zeros_like(d), torch.zeros(1, dtype=dtype), pg_w, mask, hkl_weight=hk_w))
    val.backward()
    assert torch.isfinite(val) and torch.isfinite(logp.grad).all()
    assert logp.grad[0, :3].tolist() == [0.0, 0.0, 0.0]  # saturated clamp: no gradient, as torch.clamp
    assert logp.grad[0, 3].item() == pytest.approx(math.expm1(0.5) / 4, rel=1e-6)
    for adv in (1.0, -1.0):
        for clip_c in (10.0, None):
            logp.grad = None
            loss, sums = loss_fn(LossInputs(logp, torch.zeros_like(d), torch.tensor([adv], dtype=dtype), pg_w, mask,
                                            hkl_weight=hk_w), LossSettings(clip_c=clip_c))
            loss.backward()
            assert torch.isfinite(loss), (adv, clip_c)
            assert torch.isfinite(logp.grad).all(), (adv, clip_c)
            assert logp.grad[0, :3].tolist() == [0.0, 0.0, 0.0]
            assert all(torch.isfinite(v).all() for v in sums.values())


def test_bad_delta_is_rejected():
    with pytest.raises(ValueError, match="hinge_delta=0.0: must be > 0"):
        LossSettings(hinge_delta=0.0)
