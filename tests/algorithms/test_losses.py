"""Both implementations of the loss (the fused policy_loss training calls and the literal definition) and
token_weights vs the loop-based float64 reference: split invariance; KL, TIS, entropy, metrics."""

import math

import pytest
import torch

from mcpo_megatron.algorithms import (
    LOSS_AGG_MODES,
    LossInputs,
    LossSettings,
    finalize_metrics,
    local_counts,
    token_weights,
)

from algo_reference import pg_term, phi, reference_loss

F64 = torch.float64
MAX_LEN = 12  # the configured max response length for seq-mean-token-sum-norm (>= the padded width)


def make_batch(seed=0, B=10, T=9):
    g = torch.Generator().manual_seed(seed)
    lengths = [int(x) for x in torch.randint(1, T + 1, (B,), generator=g)]
    lengths[0] = T
    lengths[3] = 0  # an empty response: excluded from N and |M_B|
    old = -2 * torch.rand(B, T, generator=g, dtype=F64)
    d = 0.3 * torch.randn(B, T, generator=g, dtype=F64)
    d[1, 0] = 3.0  # r = 20 > clip_c with A < 0: dual clip
    d[2, 1] = -2.0  # deep below 1 - clip_low
    adv = torch.randn(B, generator=g, dtype=F64)
    adv[1], adv[2], adv[4] = -1.5, -0.7, 0.0
    mask = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
    # padding holds arbitrary finite values: results must not depend on them
    logp = torch.where(mask, old + d, torch.full_like(d, 5.0))
    old = torch.where(mask, old, torch.full_like(d, -7.0))
    mastered = torch.tensor([i % 3 == 0 for i in range(B)])  # includes the empty row 3
    return dict(lengths=lengths, logp=logp, old=old, adv=adv, mask=mask, mastered=mastered)


def run_library(loss_fn, b, splits, *, mode, hinge_agg="mastered", hinge=True, ratio_level="token", **kw):
    """Sum of micro-batch losses and gradients; ``splits`` = list of ranks, each a list of micro-batch row lists.

    Counts are summed over every micro-batch of every rank first, as the all-reduce would.
    """
    logp = b["logp"].clone().requires_grad_(True)
    mbs = [rows for rank in splits for rows in rank]

    def cut(rows):
        width = max(1, max(b["lengths"][i] for i in rows))
        idx = torch.tensor(rows)
        return idx, width

    glob = torch.zeros(3, dtype=F64)
    for rows in mbs:
        idx, width = cut(rows)
        glob += local_counts(b["mask"][idx, :width], b["mastered"][idx])
    total, sums_total = 0.0, None
    for rows in mbs:
        idx, width = cut(rows)
        mask = b["mask"][idx, :width]
        pg_w, hk_w = token_weights(mask, b["mastered"][idx], loss_agg_mode=mode, global_counts=glob,
                                   max_response_length=MAX_LEN, hinge_agg=hinge_agg, dtype=F64)
        loss, sums = loss_fn(LossInputs(logp[idx, :width], b["old"][idx, :width], b["adv"][idx], pg_w, mask,
                                        hkl_weight=hk_w if hinge else None),
                             LossSettings(ratio_level=ratio_level, **kw))
        loss.backward()
        total = total + loss.detach()
        sums_total = _add(sums_total, sums)
    return total, logp.grad, sums_total


def _add(total: dict | None, sums: dict) -> dict:
    """Micro-batch metric sums added up (what the policy's all-reduce of them gives on one rank)."""
    out = dict(total or {})
    for k, v in sums.items():
        out[k] = out[k] + v if k in out else v
    return out


def run_reference(b, *, mode, hinge_agg="mastered", hinge=True, ratio_level="token", **kw):
    leaf = b["logp"].clone().requires_grad_(True)
    n = b["lengths"]
    loss = reference_loss([leaf[i, :n[i]] for i in range(len(n))], [b["old"][i, :n[i]] for i in range(len(n))], n,
                          b["adv"].tolist(), b["mastered"].tolist(), mode=mode, max_len=MAX_LEN, hinge=hinge,
                          hinge_agg=hinge_agg, ratio_level=ratio_level, **kw)
    loss.backward()
    return loss.detach(), leaf.grad


SPLITS = {
    "one micro-batch": [[list(range(10))]],
    "four micro-batches": [[[0, 1, 2], [3, 4], [5, 6, 7], [8, 9]]],
    "two DP ranks x two micro-batches": [[[0, 2, 4], [6, 8]], [[1, 3], [5, 7, 9]]],
}


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("hinge_agg", ["mastered", "batch"])
def test_split_invariance_against_reference(loss_fn, mode, hinge_agg):
    b = make_batch(seed=1)
    ref_loss, ref_grad = run_reference(b, mode=mode, hinge_agg=hinge_agg)
    for name, split in SPLITS.items():
        loss, grad, sums = run_library(loss_fn, b, split, mode=mode, hinge_agg=hinge_agg)
        assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-12, abs=1e-15), name
        assert torch.allclose(grad, ref_grad, rtol=1e-11, atol=1e-15), name
        assert float(sums["dual_clipped"]) >= 1 and float(sums["pg_clipped_low"]) >= 1, name
        assert float(sums["hinge_value"]) > 0, name


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_split_invariance_without_hinge_and_without_dual_clip(loss_fn, mode):
    b = make_batch(seed=2)
    ref_loss, ref_grad = run_reference(b, mode=mode, hinge=False, clip_c=None)
    for name, split in SPLITS.items():
        loss, grad, _ = run_library(loss_fn, b, split, mode=mode, hinge=False, clip_c=None)
        assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-12, abs=1e-15), name
        assert torch.allclose(grad, ref_grad, rtol=1e-11, atol=1e-15), name


@pytest.mark.parametrize("clip", [(3e-4, 4e-4), (0.2, 0.28)])
@pytest.mark.parametrize("clip_c", [None, 10.0])
def test_gspo_sequence_ratio_against_direct_reference(loss_fn, clip, clip_c):
    b = make_batch(seed=3)
    b["logp"] = b["old"] + 0.5 * (b["logp"] - b["old"])  # sequence means of d around +-0.1
    kw = dict(clip_low=clip[0], clip_high=clip[1], clip_c=clip_c)
    ref_loss, ref_grad = run_reference(b, mode="seq-mean-token-mean", ratio_level="sequence", **kw)
    for name, split in SPLITS.items():
        loss, grad, sums = run_library(loss_fn, b, split, mode="seq-mean-token-mean", ratio_level="sequence", **kw)
        assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-12, abs=1e-15), name
        assert torch.allclose(grad, ref_grad, rtol=1e-11, atol=1e-15), name


def test_gspo_clips_whole_sequences(loss_fn):
    # one sequence with mean drift 0.1: with GSPO's eps every token of it is clipped (A > 0), none is with tokens
    logp = torch.tensor([[0.3, -0.1, 0.1]], dtype=F64, requires_grad=True)
    mask = torch.ones(1, 3, dtype=torch.bool)
    w = torch.full((1, 3), 1 / 3, dtype=F64)
    adv = torch.tensor([1.0], dtype=F64)
    loss, sums = loss_fn(LossInputs(logp, torch.zeros(1, 3, dtype=F64), adv, w, mask),
                         LossSettings(ratio_level="sequence", clip_low=3e-4, clip_high=4e-4))
    loss.backward()
    assert float(sums["pg_clipped_high"]) == 3
    assert loss.item() == pytest.approx(-(1 + 4e-4), rel=1e-14)
    assert torch.count_nonzero(logp.grad) == 0
    assert float(sums["ratio_sum"]) == pytest.approx(3 * math.exp(0.1), rel=1e-14)


def test_token_weights_values():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 0, 0]], dtype=torch.bool)
    mastered = torch.tensor([True, False, True, True])  # row 2 is empty: not counted
    c = local_counts(mask, mastered)
    assert c.tolist() == [6.0, 3.0, 2.0] and c.dtype == F64
    kw = dict(global_counts=c, dtype=F64)
    pg, hk = token_weights(mask, mastered, loss_agg_mode="seq-mean-token-mean", **kw)
    assert pg[0, :3].tolist() == [1 / 9] * 3 and pg[1, 0].item() == 1 / 3 and pg[3, :2].tolist() == [1 / 6] * 2
    assert hk[0, :3].tolist() == [1 / 6] * 3 and hk[3, :2].tolist() == [1 / 4] * 2 and hk[1].sum() == 0
    assert pg[~mask].abs().sum() == 0 and hk[~mask].abs().sum() == 0 and hk[2].sum() == 0
    pg, _ = token_weights(mask, mastered, loss_agg_mode="token-mean", **kw)
    assert torch.allclose(pg[mask], torch.full((6,), 1 / 6, dtype=F64))
    pg, _ = token_weights(mask, mastered, loss_agg_mode="seq-mean-token-sum", **kw)
    assert torch.allclose(pg[mask], torch.full((6,), 1 / 3, dtype=F64))
    pg, hb = token_weights(mask, mastered, loss_agg_mode="seq-mean-token-sum-norm", max_response_length=8,
                           hinge_agg="batch", **kw)
    assert torch.allclose(pg[mask], torch.full((6,), 1 / 24, dtype=F64))
    assert hb[0, :3].tolist() == [1 / 9] * 3  # 1/(|y| N)
    # the batch aggregation is (|M_B| / N) times the mastered one
    _, hm = token_weights(mask, mastered, loss_agg_mode="token-mean", **kw)
    assert torch.allclose(hb, hm * 2 / 3)


def test_no_mastered_sequence_gives_zero_hinge_weights(loss_fn):
    mask = torch.ones(2, 3, dtype=torch.bool)
    none = torch.tensor([False, False])
    pg, hk = token_weights(mask, none, loss_agg_mode="seq-mean-token-mean", global_counts=(6, 2, 0))
    assert torch.count_nonzero(hk) == 0 and pg.dtype == torch.float32
    logp = torch.zeros(2, 3, requires_grad=True)
    loss, sums = loss_fn(LossInputs(logp, torch.full((2, 3), 0.5), torch.zeros(2), pg, mask, hkl_weight=hk))
    assert float(sums["hinge_value"]) == 0 and float(sums["hinge_tokens"]) == 0
    assert finalize_metrics(sums)["hkl/active_frac"] == 0.0


def test_all_empty_micro_batch_gives_zero_loss(loss_fn):
    mask = torch.zeros(2, 4, dtype=torch.bool)
    m = torch.tensor([True, False])
    pg, hk = token_weights(mask, m, loss_agg_mode="seq-mean-token-mean", global_counts=(10, 3, 1))
    logp = torch.randn(2, 4, requires_grad=True)
    loss, sums = loss_fn(LossInputs(logp, torch.zeros(2, 4), torch.ones(2), pg, mask, hkl_weight=hk))
    loss.backward()
    assert loss.item() == 0 and torch.count_nonzero(logp.grad) == 0 and float(sums["tokens"]) == 0


def test_token_advantages_equal_broadcast_sequence_advantages(loss_fn):
    b = make_batch(seed=4)
    mask = b["mask"]
    c = local_counts(mask, b["mastered"])
    pg, hk = token_weights(mask, b["mastered"], loss_agg_mode="token-mean", global_counts=c, dtype=F64)
    out = []
    for adv in (b["adv"], b["adv"][:, None].expand_as(mask).contiguous()):
        logp = b["logp"].clone().requires_grad_(True)
        loss, sums = loss_fn(LossInputs(logp, b["old"], adv, pg, mask, hkl_weight=hk))
        loss.backward()
        out.append((loss.item(), logp.grad, {k: float(v) for k, v in sums.items()}))
    assert out[0][0] == pytest.approx(out[1][0], rel=1e-14)
    assert torch.allclose(out[0][1], out[1][1], rtol=1e-14, atol=0)
    for k in out[0][2]:
        assert out[0][2][k] == pytest.approx(out[1][2][k], rel=1e-12, abs=1e-15), k


def test_clip_metrics_count_each_case(loss_fn):
    # token r values and advantages chosen to land in each region
    r = torch.tensor([[1.5, 1.1, 0.5, 0.9], [0.5, 20.0, 1.5, 0.9]], dtype=F64)
    adv = torch.tensor([[1.0, 1.0, 1.0, 0.0], [-1.0, -1.0, -1.0, -1.0]], dtype=F64)
    logp = torch.log(r).requires_grad_(True)
    mask = torch.ones(2, 4, dtype=torch.bool)
    w = torch.full((2, 4), 0.125, dtype=F64)
    loss, sums = loss_fn(LossInputs(logp, torch.zeros(2, 4, dtype=F64), adv, w, mask))
    loss.backward()
    # row 0: 1.5 > 1.28 clipped high; 1.1 inside; 0.5 with A > 0 not clipped; A = 0 never clipped
    # row 1: 0.5 < 0.8 clipped low; 20 > c dual clipped; 1.5 with A < 0 inside; 0.9 inside
    assert [float(sums[k]) for k in ("pg_clipped_high", "pg_clipped_low", "dual_clipped")] == [1.0, 1.0, 1.0]
    expected_grad = torch.tensor([[0, -1.1, -0.5, 0], [0, 0, 1.5, 0.9]], dtype=F64) * 0.125
    assert torch.allclose(logp.grad, expected_grad, rtol=1e-14)
    expected_loss = 0.125 * (-1.28 - 1.1 - 0.5 + 0 + 0.8 + 10.0 + 1.5 + 0.9)
    assert loss.item() == pytest.approx(expected_loss, rel=1e-14)
    fin = finalize_metrics(sums)
    assert fin["actor/pg_clipfrac"] == 2 / 8 and fin["actor/pg_clipfrac_dual"] == 1 / 8
    assert fin["actor/ratio_mean"] == pytest.approx(float(r.mean()), rel=1e-14)


@pytest.mark.parametrize("kl_type", ["k1", "k2", "k3"])
def test_reference_kl_against_autograd(loss_fn, kl_type):
    b = make_batch(seed=5)
    mask = b["mask"]
    c = local_counts(mask, b["mastered"])
    pg, _ = token_weights(mask, b["mastered"], loss_agg_mode="seq-mean-token-mean", global_counts=c, dtype=F64)
    g = torch.Generator().manual_seed(7)
    ref = b["logp"] + 0.4 * torch.randn(b["logp"].shape, generator=g, dtype=F64)
    ref[0, 0] = b["logp"][0, 0] + 15.0  # k3 beyond its clamp at 10
    ref[0, 1] = b["logp"][0, 1] + 25.0  # log-ratio beyond verl's clamp at 20
    ref[0, 2] = b["logp"][0, 2] - 25.0
    ref[0, 3] = b["logp"][0, 3] - 2.5  # k3 = e^-2.5 + 1.5, below the clamp
    logp = b["logp"].clone().requires_grad_(True)
    loss_kl, sums_kl = loss_fn(LossInputs(logp, b["old"], b["adv"], pg, mask, ref_logp=ref),
                               LossSettings(kl_coef=0.3, kl_type=kl_type))
    loss_kl.backward()
    grad_kl = logp.grad.clone()
    logp.grad = None
    loss0, _ = loss_fn(LossInputs(logp, b["old"], b["adv"], pg, mask))
    loss0.backward()
    # direct autograd of the KL term alone
    leaf = b["logp"].clone().requires_grad_(True)
    x = ref - leaf
    if kl_type == "k1":
        kl = -x
    elif kl_type == "k2":
        kl = 0.5 * x ** 2
    else:  # verl's low_var_kl literally: kl = clamp(ref - logp, -20, 20); clamp(e^kl - kl - 1, -10, 10)
        x = torch.clamp(x, min=-20, max=20)
        kl = torch.clamp(torch.exp(x) - x - 1, min=-10, max=10)
    term = 0.3 * (pg * torch.where(mask, kl, torch.zeros_like(kl))).sum()
    term.backward()
    assert (loss_kl - loss0).item() == pytest.approx(term.item(), rel=1e-11)
    assert torch.allclose(grad_kl - logp.grad, leaf.grad, rtol=1e-10, atol=1e-14)
    assert float(sums_kl["kl_sum"]) == pytest.approx(float(kl.detach()[mask].sum()), rel=1e-11)


@pytest.mark.parametrize("log_ratio_clamp, d_clamp", [(1.0, 0.5), (0.5, 1.0)])
def test_log_ratio_and_hinge_clamps_act_on_their_own_terms(loss_fn, log_ratio_clamp, d_clamp):
    """The PG ratio (and the TIS weight) use log_ratio_clamp, the hinge-KL its own d_clamp: each term has the value
    and the gradient (0 where its clamp is active) of torch.clamp on d = logp - old with its own bound."""
    d = torch.tensor([[0.2, -0.7, 0.8, 2.5, -3.0], [-0.3, 0.6, -0.05, 1.2, 0.0]], dtype=F64)
    old = torch.full_like(d, -1.5)
    adv = torch.tensor([0.8, -1.3], dtype=F64)
    mask = torch.ones(2, 5, dtype=torch.bool)
    rollout = old - torch.tensor([[0.1, 1.7, -0.4, 0.0, 3.0], [0.0, -2.0, 0.3, 0.2, 0.5]], dtype=F64)
    w = torch.full((2, 5), 0.1, dtype=F64)
    logp = (old + d).requires_grad_(True)
    loss, _ = loss_fn(LossInputs(logp, old, adv, w, mask, hkl_weight=w, rollout_logp=rollout),
                      LossSettings(log_ratio_clamp=log_ratio_clamp, d_clamp=d_clamp, tis_cap=2.0))
    loss.backward()

    leaf = (old + d).requires_grad_(True)
    want = torch.zeros((), dtype=F64)
    for i in range(2):
        for t in range(5):
            dt = leaf[i, t] - old[i, t]
            r = torch.exp(torch.clamp(dt, -log_ratio_clamp, log_ratio_clamp))
            x = torch.clamp(old[i, t] - rollout[i, t], -log_ratio_clamp, log_ratio_clamp)
            tis = torch.clamp(torch.exp(x), max=2.0)
            want = want + 0.1 * tis * pg_term(r, float(adv[i]), 0.2, 0.28, 10.0)
            want = want + 0.1 * phi(torch.clamp(dt, -d_clamp, d_clamp), 0.01)
    want.backward()
    assert loss.item() == pytest.approx(want.item(), rel=1e-12)
    torch.testing.assert_close(logp.grad, leaf.grad, rtol=1e-10, atol=1e-14)


def test_reference_k3_in_float32_stays_finite_beyond_exp_range(loss_fn):
    """x = ref - logp = +-100: e^100 overflows float32; verl's clamp of x at 20 keeps the value at 10, gradient 0."""
    logp = torch.tensor([[-1.0, -2.0, -3.0]], dtype=torch.float32, requires_grad=True)
    ref = logp.detach() + torch.tensor([[100.0, -100.0, 0.5]])
    w = torch.full((1, 3), 1.0 / 3)
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, sums = loss_fn(LossInputs(logp, logp.detach(), torch.zeros(1), w, mask, ref_logp=ref),
                         LossSettings(kl_coef=1.0, kl_type="k3"))
    loss.backward()
    k3_half = math.exp(0.5) - 0.5 - 1.0
    assert float(sums["kl_sum"]) == pytest.approx(10.0 + 10.0 + k3_half, rel=1e-6)
    assert logp.grad.tolist()[0][:2] == [0.0, 0.0]
    assert logp.grad[0, 2].item() == pytest.approx(-(math.exp(0.5) - 1.0) / 3, rel=1e-6)


def test_tis_weight_multiplies_the_pg_term_only(loss_fn):
    b = make_batch(seed=6)
    mask = b["mask"]
    c = local_counts(mask, b["mastered"])
    pg, hk = token_weights(mask, b["mastered"], loss_agg_mode="token-mean", global_counts=c, dtype=F64)
    g = torch.Generator().manual_seed(8)
    rollout = b["old"] + 0.5 * torch.randn(b["old"].shape, generator=g, dtype=F64)
    cap = 1.5
    tis = torch.clamp(torch.exp(b["old"] - rollout), max=cap)
    logp = b["logp"].clone().requires_grad_(True)
    loss, sums = loss_fn(LossInputs(logp, b["old"], b["adv"], pg, mask, rollout_logp=rollout, hkl_weight=hk),
                         LossSettings(tis_cap=cap))
    loss.backward()
    # reference: the same loss with pg weights scaled by the (constant) TIS weight, hinge weights unchanged
    logp2 = b["logp"].clone().requires_grad_(True)
    loss2, _ = loss_fn(LossInputs(logp2, b["old"], b["adv"], pg * tis, mask, hkl_weight=hk))
    loss2.backward()
    assert loss.item() == pytest.approx(loss2.item(), rel=1e-13)
    assert torch.allclose(logp.grad, logp2.grad, rtol=1e-13, atol=1e-16)
    n_capped = int(((torch.exp(b["old"] - rollout) > cap) & mask).sum())
    assert float(sums["tis_capped"]) == n_capped > 0
    assert float(sums["tis_sum"]) == pytest.approx(float(tis[mask].sum()), rel=1e-13)
    assert float(sums["mismatch_abs_sum"]) == pytest.approx(float((b["old"] - rollout)[mask].abs().sum()), rel=1e-13)


def test_entropy_bonus_gradient_flows_into_entropy(loss_fn):
    b = make_batch(seed=9)
    mask = b["mask"]
    c = local_counts(mask, b["mastered"])
    pg, _ = token_weights(mask, b["mastered"], loss_agg_mode="seq-mean-token-mean", global_counts=c, dtype=F64)
    ent = torch.rand(mask.shape, dtype=F64, requires_grad=True)
    logp = b["logp"].clone().requires_grad_(True)
    loss, sums = loss_fn(LossInputs(logp, b["old"], b["adv"], pg, mask, entropy=ent), LossSettings(entropy_coeff=0.01))
    loss0, _ = loss_fn(LossInputs(b["logp"], b["old"], b["adv"], pg, mask))
    loss.backward()
    assert (loss0 - loss).item() == pytest.approx(0.01 * float((pg * ent.detach()).sum()), rel=1e-12)
    assert torch.allclose(ent.grad, -0.01 * pg, rtol=1e-15)
    assert float(sums["entropy_sum"]) == pytest.approx(float(ent.detach()[mask].sum()), rel=1e-13)


def test_metric_sums_compose_over_micro_batches(loss_fn):
    b = make_batch(seed=10)
    _, _, one = run_library(loss_fn, b, SPLITS["one micro-batch"], mode="seq-mean-token-mean")
    _, _, four = run_library(loss_fn, b, SPLITS["two DP ranks x two micro-batches"], mode="seq-mean-token-mean")
    assert set(one) == set(four)
    for k in one:
        assert float(four[k]) == pytest.approx(float(one[k]), rel=1e-12, abs=1e-15), k
    fin = finalize_metrics(four)
    n_tok = int(b["mask"].sum())
    mastered_tok = sum(n for n, m in zip(b["lengths"], b["mastered"].tolist()) if m)
    d = (b["logp"] - b["old"])
    rows = b["mastered"][:, None] & b["mask"]
    assert fin["hkl/mastered_token_frac"] == pytest.approx(mastered_tok / n_tok, rel=1e-14)
    assert fin["hkl/active_frac"] == pytest.approx(float((d.abs() > 0.01)[rows].sum()) / mastered_tok, rel=1e-14)
    assert fin["hkl/mean_abs_d"] == pytest.approx(float(d.abs()[rows].sum()) / mastered_tok, rel=1e-12)
    assert fin["actor/ppo_kl"] == pytest.approx(float(-d[b["mask"]].mean()), rel=1e-12)
    assert fin["actor/loss"] == pytest.approx(fin["actor/pg_loss"] + fin["hkl/loss"], rel=1e-12)


def test_float32_inputs_compute_in_float32_and_return_float32_grads(loss_fn):
    b = make_batch(seed=11)
    mask = b["mask"]
    c = local_counts(mask, b["mastered"])
    pg, hk = token_weights(mask, b["mastered"], loss_agg_mode="seq-mean-token-mean", global_counts=c)
    logp = b["logp"].float().requires_grad_(True)
    loss, _ = loss_fn(LossInputs(logp, b["old"].float(), b["adv"].float(), pg, mask, hkl_weight=hk))
    loss.backward()
    assert loss.dtype == torch.float32 and logp.grad.dtype == torch.float32
    ref_loss, ref_grad = run_reference(b, mode="seq-mean-token-mean")
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-5)
    assert torch.allclose(logp.grad.double(), ref_grad, rtol=1e-4, atol=1e-7)


def test_bad_arguments_are_rejected(loss_fn):
    mask = torch.ones(2, 3, dtype=torch.bool)
    m = torch.tensor([True, False])
    with pytest.raises(ValueError, match="loss_agg_mode='mean'"):
        token_weights(mask, m, loss_agg_mode="mean", global_counts=(6, 2, 1))
    with pytest.raises(ValueError, match="max_response_length"):
        token_weights(mask, m, loss_agg_mode="seq-mean-token-sum-norm", global_counts=(6, 2, 1))
    with pytest.raises(ValueError, match=r"global_counts\[1\] \(sequences\) = 1.0: smaller than"):
        token_weights(mask, m, loss_agg_mode="token-mean", global_counts=(6, 1, 1))
    with pytest.raises(ValueError, match=r"mastered: expected shape \[2\]"):
        local_counts(mask, torch.tensor([True]))
    z = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="clip_c=0.5"):
        loss_fn(LossInputs(z, z, torch.zeros(2), z, mask), LossSettings(clip_c=0.5))
    with pytest.raises(ValueError, match="old_logp: shape"):
        loss_fn(LossInputs(z, torch.zeros(2, 4), torch.zeros(2), z, mask))
    with pytest.raises(ValueError, match="advantages: shape"):
        loss_fn(LossInputs(z, z, torch.zeros(3), z, mask))
    with pytest.raises(ValueError, match="kl_coef=0.1 needs ref_logp"):
        loss_fn(LossInputs(z, z, torch.zeros(2), z, mask), LossSettings(kl_coef=0.1))
    with pytest.raises(ValueError, match="ratio_level='seq'"):
        loss_fn(LossInputs(z, z, torch.zeros(2), z, mask), LossSettings(ratio_level="seq"))


def test_non_finite_padding_does_not_leak(loss_fn):
    b = make_batch(seed=13)
    mask = b["mask"]
    c = local_counts(mask, b["mastered"])
    pg, hk = token_weights(mask, b["mastered"], loss_agg_mode="seq-mean-token-mean", global_counts=c, dtype=F64)
    g = torch.Generator().manual_seed(14)
    ref = b["logp"] + 0.1 * torch.randn(mask.shape, generator=g, dtype=F64)
    rollout = b["old"] + 0.1 * torch.randn(mask.shape, generator=g, dtype=F64)
    ent = torch.rand(mask.shape, generator=g, dtype=F64)
    results = []
    for fill in (0.0, float("-inf"), float("nan")):
        def pad(x):
            return torch.where(mask, x, torch.full_like(x, fill))
        logp = pad(b["logp"]).requires_grad_(True)
        loss, sums = loss_fn(LossInputs(logp, pad(b["old"]), b["adv"], pg, mask, hkl_weight=hk, ref_logp=pad(ref),
                                        rollout_logp=pad(rollout), entropy=pad(ent)),
                             LossSettings(kl_coef=0.1, tis_cap=2.0, entropy_coeff=0.01))
        loss.backward()
        results.append((loss.item(), logp.grad, {k: float(v) for k, v in sums.items()}))
    for loss, grad, sums in results[1:]:
        assert math.isfinite(loss) and loss == pytest.approx(results[0][0], rel=1e-13)
        assert torch.allclose(grad, results[0][1], rtol=1e-13, atol=0)
        assert sums == pytest.approx(results[0][2], rel=1e-12)
