"""The off-policy masks and the behaviour ratio's statistics (algorithms/off_policy.py, docs/algorithms.md §8)
against plain float64 Python, and their place in the loss: a masked token contributes no PG term and no PG
gradient, every denominator unchanged."""

from __future__ import annotations

import math

import pytest
import torch

from mcpo_megatron.algorithms import LossInputs, LossSettings, literal_policy_loss, policy_loss
from mcpo_megatron.algorithms.off_policy import (MaskSettings, RatioStats, behaviour_mask, in_band,
                                                 sequence_log_ratio)

F64 = torch.float64


def rows(seed=0, B=9, T=30):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g).tolist()
    old = [-2 * torch.rand(n, generator=g, dtype=F64) for n in lengths]
    roll = [o + 0.4 * torch.randn(n, generator=g, dtype=F64) for o, n in zip(old, lengths)]
    roll[0] = old[0].clone()  # on-policy: ratio 1 everywhere
    return old, roll


def reference_mask(old, roll, token_band, seq_band, ratio):
    """Per token, plain Python: rho = exp(old - roll); the sequence ratio is the geometric mean or the product."""
    rho = [math.exp(a - b) for a, b in zip(old.tolist(), roll.tolist())]
    logs = [math.log(r) for r in rho]
    seq = math.exp(sum(logs) / len(logs)) if ratio == "geometric" else math.exp(sum(logs))
    keep_seq = seq_band is None or seq_band[0] <= seq <= seq_band[1]
    return [float(keep_seq and (token_band is None or token_band[0] <= r <= token_band[1])) for r in rho]


@pytest.mark.parametrize("token_band,seq_band,ratio", [
    ((0.5, 5.0), None, "geometric"), ((0.8, 1.25), None, "geometric"), (None, (0.9, 1.1), "geometric"),
    (None, (0.5, 2.0), "product"), ((0.7, 1.5), (0.95, 1.05), "geometric"), ((1.0, 1.0), None, "geometric")])
def test_masks_equal_a_plain_python_reference(token_band, seq_band, ratio):
    settings = MaskSettings(token_band=token_band, sequence_band=seq_band, sequence_ratio=ratio)
    masked_any = kept_any = False
    for old, roll in zip(*rows()):
        got = behaviour_mask(old, roll, settings).tolist()
        assert got == reference_mask(old, roll, token_band, seq_band, ratio)
        masked_any |= 0.0 in got
        kept_any |= 1.0 in got
    assert kept_any and (masked_any or token_band == (0.5, 5.0))
    old, roll = rows()
    assert behaviour_mask(old[0], roll[0], settings).tolist() == [1.0] * len(old[0])  # on-policy: never masked


def test_sequence_ratio_and_band_in_log_space():
    lr = torch.tensor([0.1, -0.3, 0.5], dtype=F64)
    assert sequence_log_ratio(lr, "geometric") == pytest.approx(0.1)
    assert sequence_log_ratio(lr, "product") == pytest.approx(0.3)
    assert sequence_log_ratio(torch.zeros(0, dtype=F64)) == 0.0
    # a product over 20,000 tokens overflows exp; the band is compared on the log
    assert not in_band(20000 * 0.1, (0.5, 2.0)) and in_band(math.log(2.0), (0.5, 2.0))
    with pytest.raises(ValueError, match="ratio='mean'"):
        sequence_log_ratio(lr, "mean")
    with pytest.raises(ValueError, match="need 0 < low <= 1 <= high"):
        MaskSettings(token_band=(1.2, 2.0))


def test_ratio_statistics_equal_plain_python():
    old, roll = rows(seed=3)
    settings = MaskSettings(token_band=(0.8, 1.25), sequence_band=(0.9, 1.1))
    st = RatioStats()
    masks = [behaviour_mask(o, r, settings) for o, r in zip(old, roll)]
    for o, r, m in zip(old, roll, masks):
        st.add(o, r, m)
    rho = [math.exp(a - b) for o, r in zip(old, roll) for a, b in zip(o.tolist(), r.tolist())]
    seq = [math.exp(sum(a - b for a, b in zip(o.tolist(), r.tolist())) / len(o)) for o, r in zip(old, roll)]
    m = st.metrics()
    assert m["offpolicy/ratio_mean"] == pytest.approx(sum(rho) / len(rho), rel=1e-12)
    assert (m["offpolicy/ratio_min"], m["offpolicy/ratio_max"]) == pytest.approx((min(rho), max(rho)), rel=1e-12)
    assert m["offpolicy/seq_ratio_mean"] == pytest.approx(sum(seq) / len(seq), rel=1e-12)
    assert (m["offpolicy/seq_ratio_min"], m["offpolicy/seq_ratio_max"]) == pytest.approx((min(seq), max(seq)))
    flat = [x for mk in masks for x in mk.tolist()]
    assert m["offpolicy/masked_token_frac"] == flat.count(0.0) / len(flat) > 0
    whole = sum(all(x == 0 for x in mk.tolist()) for mk in masks)
    assert m["offpolicy/masked_seq_frac"] == whole / len(masks) > 0
    assert RatioStats().metrics()["offpolicy/ratio_mean"] == 1.0  # nothing seen: on-policy


@pytest.mark.parametrize("loss_fn", [policy_loss, literal_policy_loss], ids=["fused", "literal"])
def test_a_masked_token_has_no_pg_term_and_keeps_its_denominators(loss_fn):
    """The mask is an importance weight of 0 on the PG term: the loss and gradient equal those with the PG weight
    multiplied by the mask (the weights of §4, denominators included, are those of the unmasked batch), and the
    hinge-KL of a masked token still acts."""
    g = torch.Generator().manual_seed(1)
    B, T = 4, 6
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 4:] = False
    old = -torch.rand(B, T, generator=g, dtype=F64)
    logp = old + 0.2 * torch.randn(B, T, generator=g, dtype=F64)
    roll = old + 0.3 * torch.randn(B, T, generator=g, dtype=F64)
    adv = torch.randn(B, generator=g, dtype=F64)
    w = mask.double() / mask.sum(-1, keepdim=True) / B
    hkl = w.clone()
    keep = (torch.rand(B, T, generator=g) > 0.4).double()
    settings = LossSettings(tis_cap=2.0)

    def run(pg_weight, behaviour):
        lp = logp.clone().requires_grad_(True)
        loss, sums = loss_fn(LossInputs(lp, old, adv, pg_weight, mask, hkl_weight=hkl, rollout_logp=roll,
                                        behaviour_mask=behaviour), settings)
        loss.backward()
        return loss.detach(), lp.grad, sums

    masked = run(w, keep)
    reweighted = run(w * keep, None)
    torch.testing.assert_close(masked[0], reweighted[0], rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(masked[1], reweighted[1], rtol=1e-12, atol=1e-15)
    assert masked[2]["tokens"] == reweighted[2]["tokens"] == mask.sum()
    pg_only = run(w, torch.zeros(B, T, dtype=F64))  # every token masked: only the hinge is left
    assert float(pg_only[2]["pg_loss"]) == 0.0 and float(pg_only[2]["hkl_loss"]) > 0
