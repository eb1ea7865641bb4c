"""The policy loss of one micro-batch as training computes it: values and per-token gradients in one fused pass.

The loss is defined in ``literal_loss.py`` (autograd through plain torch ops, each term citing its equation;
docs/algorithms.md §2-§8 and §15):

    L = L_PG + beta * L_HKL  (+ kl_coef * L_KL - entropy_coeff * H, both off in every preset),

every term a *sum* of per-token terms times a weight from ``aggregation.token_weights`` (§4). All terms are
element-wise in ``logp``, so ``policy_loss`` computes the per-token gradient in the same no-grad pass as the
value and hands it to autograd through ``_ElementwiseGrad``, instead of storing a dozen intermediates for the
backward pass. Tests hold it equal to the literal definition (tests/algorithms/test_literal_loss.py).

Training calls this fused path, and not for speed or memory: at recipe scale (bench/bench_losses.py --vs-literal,
docs/algorithms.md §15) the literal definition takes about 1.4 ms more CPU time and 1-2 MiB more memory per
micro-batch, some 0.3 s per optimizer step and rank, next to minutes of the model's forward and backward. It stays
because the two round differently in float32 (the order of the products, the hinge's expm1 form): switching would
change the trained weights in their last bits, and runs would no longer repeat earlier runs bit for bit.

This module also gathers the loss's public names (weights, settings, metrics), as the trainer uses them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ._checks import as_bool
from .aggregation import HINGE_AGGS, LOSS_AGG_MODES, local_counts, token_weights
from .kl import k3
from .loss_metrics import FINAL_METRIC_KEYS, METRIC_SUM_KEYS, finalize_metrics
from .loss_settings import (
    DEFAULT_SETTINGS,
    K3_LOG_RATIO_MAX,
    K3_VALUE_MAX,
    KL_TYPES,
    RATIO_LEVELS,
    LossInputs,
    LossSettings,
)

__all__ = [
    "FINAL_METRIC_KEYS", "HINGE_AGGS", "KL_TYPES", "LOSS_AGG_MODES", "METRIC_SUM_KEYS", "RATIO_LEVELS",
    "DEFAULT_SETTINGS", "LossInputs", "LossSettings", "finalize_metrics", "local_counts", "policy_loss",
    "token_weights",
]

def policy_loss(inputs: LossInputs, settings: LossSettings = DEFAULT_SETTINGS,
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss of one micro-batch and its metric sums, with hand-derived per-token gradients: the same arguments,
    results and definition as ``literal_loss.literal_policy_loss`` (read that one for the terms, and
    docs/algorithms.md §5-§8), computed as training needs it.

    PG term: ``max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))``, for A < 0 at most ``-A clip_c``, is computed
    as ``-A * clamp(r, lo, hi)`` with (lo, hi) = (0, 1 + clip_high) for A > 0 and (1 - clip_low, clip_c) for
    A < 0; its gradient is ``-A r`` where the clamp is inactive and 0 where it is active. With
    ``ratio_level="sequence"`` (GSPO-token, §5) r is the sequence's ratio s_i on every token of it and the
    gradient ``-A_i s_i w_t``. Truncated importance sampling multiplies each token's PG term by the detached weight
    ``min(exp(old_logp - rollout_logp), tis_cap)``; without a cap only the mismatch metrics are computed (§8). The
    hinge is computed by ``_hinge_rows`` on the mastered rows only.

    Args:
        inputs: the per-token tensors (:class:`LossInputs`: which are optional, and what each switches on).
        settings: the scalar settings (:class:`LossSettings`).

    Returns:
        ``(loss, metric_sums)``: loss is a 0-d tensor; metric_sums maps names to 0-d tensors (int64 counts,
        floating sums) that compose by addition over micro-batches and ranks (see ``METRIC_SUM_KEYS``);
        ``finalize_metrics`` turns them into means. Computation is in float32, or float64 for float64 input.
    """
    st, x = settings, inputs
    x.check(st)
    logp, entropy = x.logp, x.entropy
    cdtype = torch.promote_types(logp.dtype, torch.float32)
    sums: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        tok = _Tokens.of(x.mask, cdtype)
        w = x.pg_weight.to(cdtype)
        d, d_hinge, saturated, hinge_saturated = _log_ratios(logp, x.old_logp, tok.valid, st,
                                                             hinge=x.hkl_weight is not None)
        loss, grad = _clipped_pg(d, saturated, w, x, tok, st, sums)
        if x.hkl_weight is not None:
            loss = loss + _add_hinge(d_hinge, hinge_saturated, x.hkl_weight.to(cdtype), tok.lens, grad, st, sums)
        if x.ref_logp is not None:
            kl_value = _add_reference_kl(logp, x.ref_logp, w, tok.valid, grad, st, sums)
            loss = loss + kl_value if kl_value is not None else loss
        grad_entropy = None
        if entropy is not None:
            bonus, grad_entropy = _entropy_bonus(entropy, w, tok.valid, st, sums)
            loss = loss - bonus if bonus is not None else loss
        sums["loss"] = loss

    out = _ElementwiseGrad.apply(loss, logp, grad, entropy if grad_entropy is not None else None, grad_entropy)
    return out, sums


@dataclass(frozen=True)
class _Tokens:
    """The valid tokens of a micro-batch in the forms the terms use: a bool mask, its float form, row lengths."""

    valid: torch.Tensor
    maskf: torch.Tensor
    lens: torch.Tensor

    @classmethod
    def of(cls, mask: torch.Tensor, cdtype: torch.dtype) -> "_Tokens":
        valid = as_bool(mask, "mask")
        return cls(valid, valid.to(cdtype), valid.sum(dim=-1))


class _ElementwiseGrad(torch.autograd.Function):
    """Returns a precomputed loss value; backward scales precomputed per-element gradients by the incoming grad."""

    @staticmethod
    def forward(ctx, value, logp, grad_logp, entropy, grad_entropy):
        ctx.save_for_backward(grad_logp, grad_entropy)
        ctx.logp_dtype = logp.dtype
        ctx.entropy_dtype = entropy.dtype if entropy is not None else None
        return value.clone()

    @staticmethod
    def backward(ctx, grad_out):
        grad_logp, grad_entropy = ctx.saved_tensors
        g_lp = (grad_logp * grad_out).to(ctx.logp_dtype) if ctx.needs_input_grad[1] else None
        g_ent = None
        if grad_entropy is not None and ctx.needs_input_grad[3]:
            g_ent = (grad_entropy * grad_out).to(ctx.entropy_dtype)
        return None, g_lp, None, g_ent, None



def _log_ratios(logp, old_logp, valid, st: LossSettings, *, hinge: bool):
    """d = logp - old_logp for the PG term and the hinge (0 on padding), each clamped to its own bound, and the
    masks of tokens where a clamp is active (None when none is: no gradient through a clamped log-ratio, as with
    torch.clamp)."""
    cdtype = torch.promote_types(logp.dtype, torch.float32)
    # Masks are applied by multiplication on the common path (data-dependent where/masked_fill are many times
    # slower on CPU); the rare path (a saturated log-ratio, or non-finite values in the padding) uses masked_fill,
    # which also clears inf/NaN padding.
    d = logp.detach().to(cdtype) - old_logp.to(cdtype)
    hinge_clamp = st.d_clamp if hinge else math.inf
    saturated = hinge_saturated = None
    peak = float(d.abs().amax()) if d.numel() else 0.0
    if peak <= min(st.log_ratio_clamp, hinge_clamp):
        d.mul_(valid.to(cdtype))
        return d, d, saturated, hinge_saturated
    d.masked_fill_(~valid, 0.0)
    d_hinge = d
    if hinge:
        d_hinge = d.clamp(-st.d_clamp, st.d_clamp)
        hinge_saturated = d.abs() > st.d_clamp
    saturated = d.abs() > st.log_ratio_clamp
    d.clamp_(-st.log_ratio_clamp, st.log_ratio_clamp)
    return d, d_hinge, saturated, hinge_saturated


def _clipped_pg(d, saturated, w, x: LossInputs, tok: _Tokens, st: LossSettings, sums):
    """The PG term -w A clamp(r, lo, hi) (times the TIS weight and the behaviour mask): its value and per-token
    gradient d/dlogp, and the clip, ratio and mismatch metric sums."""
    cdtype = d.dtype
    valid, maskf, lens = tok.valid, tok.maskf, tok.lens
    tokens = lens.sum()
    adv = x.advantages.to(cdtype)
    if adv.dim() == 1:
        adv = adv[:, None]
    if st.ratio_level == "token":
        r = torch.exp(d)
    else:
        seq_d = (d.sum(dim=-1, keepdim=True) / lens.clamp(min=1)[:, None]).clamp_(-st.log_ratio_clamp,
                                                                                    st.log_ratio_clamp)
        r = torch.exp(seq_d)  # [B, 1]
    # (lo, hi) = (0, 1 + clip_high) for A > 0, (1 - clip_low, clip_c) for A < 0
    posf, negf = (adv > 0).to(cdtype), (adv < 0).to(cdtype)
    big = torch.finfo(cdtype).max
    hi = posf * (1.0 + st.clip_high) + negf * (big if st.clip_c is None else st.clip_c) + (1.0 - posf - negf) * big
    lo = negf * (1.0 - st.clip_low)
    r_eff = torch.minimum(torch.maximum(r, lo), hi)
    neg_weighted_adv = w * adv  # becomes -w A (times the TIS weight)
    neg_weighted_adv.neg_()
    if x.rollout_logp is not None:
        mu = (x.old_logp.to(cdtype) - x.rollout_logp.to(cdtype)).masked_fill_(~valid, 0.0)
        mu.clamp_(-st.log_ratio_clamp, st.log_ratio_clamp)
        sums["mismatch_abs_sum"] = mu.abs().sum()
        sums["mismatch_k3_sum"] = k3(mu).sum()  # mu = log p_trainer - log p_engine: KL(engine || trainer)
        if st.tis_cap is not None:
            raw = torch.exp(mu)
            tis = raw.clamp(max=st.tis_cap)
            sums["tis_sum"] = (tis * maskf).sum()
            sums["tis_capped"] = ((raw > st.tis_cap) & valid).sum()
            neg_weighted_adv.mul_(tis)
    if x.behaviour_mask is not None:
        neg_weighted_adv.mul_(x.behaviour_mask.to(cdtype))
    pg_value = (neg_weighted_adv * r_eff).sum()
    # which bound is active: +1 the lower, -1 the upper (clip-higher or dual), 0 none; clipped = its square
    clip_side = torch.sign(r_eff - r)
    clipped = clip_side * clip_side
    grad = neg_weighted_adv * (r * (1.0 - clipped))  # -w A r where unclipped (straight-through for GSPO)
    if saturated is not None:
        grad.masked_fill_(saturated, 0.0)
    sums.update(_clip_counts(clip_side, clipped, posf, negf, tok, st, per_row=adv.shape[-1] == 1))
    sums["ratio_sum"] = (r.sum() - (valid.numel() - tokens) if st.ratio_level == "token"
                         else (r[:, 0] * lens).sum())
    sums["ppo_kl_sum"] = -d.sum()
    sums["pg_loss"] = pg_value
    return pg_value, grad


def _clip_counts(clip_side, clipped, posf, negf, tok: _Tokens, st: LossSettings, *, per_row: bool):
    """Token counts of each active clip bound: clip-higher (A > 0), dual clip (A < 0, upper) and the lower
    bound (A < 0); a sequence-level ratio counts its sequence's tokens."""
    lens = tok.lens
    if st.ratio_level == "sequence":
        if clip_side.shape[-1] == 1:  # per-sequence clip: count its tokens
            clip_side, clipped = clip_side * lens[:, None], clipped * lens[:, None]
        else:
            clip_side, clipped = clip_side * tok.maskf, clipped * tok.maskf
    elif per_row:  # reduce per row first, then weight by the row's advantage sign
        clip_side, clipped = clip_side.sum(dim=-1, keepdim=True), clipped.sum(dim=-1, keepdim=True)
    upper, lower = 0.5 * (clipped - clip_side), 0.5 * (clipped + clip_side)
    return {"tokens": lens.sum(), "seqs": (lens > 0).sum(), "pg_clipped_high": (posf * upper).sum(),
            "dual_clipped": (negf * upper).sum(), "pg_clipped_low": (negf * lower).sum()}


def _add_hinge(d_hinge, hinge_saturated, hkl_w, lens, grad, st: LossSettings, sums):
    """MCPO's hinge-KL (Eq. 10-11) on the rows with a hinge weight (mastered sequences): beta times its value,
    its gradient added into ``grad``."""
    hinge_value, hinge_grad, hinge_sums = _hinge_rows(d_hinge, hkl_w, lens, st.hinge_delta)
    if hinge_grad is not None:
        rows, dphi, wh = hinge_grad
        if hinge_saturated is not None:
            dphi.masked_fill_(hinge_saturated if rows is None else hinge_saturated.index_select(0, rows), 0.0)
        if rows is None:
            grad.addcmul_(dphi, wh, value=st.hinge_coef)
        else:
            grad.index_add_(0, rows, dphi.mul_(wh), alpha=st.hinge_coef)
    sums.update(hinge_sums)
    sums["hinge_value"] = hinge_value
    sums["hkl_loss"] = st.hinge_coef * hinge_value
    return st.hinge_coef * hinge_value


def _add_reference_kl(logp, ref_logp, w, valid, grad, st: LossSettings, sums):
    """The reference KL (weights: pg_weight, as verl aggregates it with the PG loss mode): kl_coef times its
    weighted sum (None when kl_coef is 0: then only its mean is reported), its gradient added into ``grad``."""
    cdtype = w.dtype
    x = (ref_logp.to(cdtype) - logp.detach().to(cdtype)).masked_fill_(~valid, 0.0)
    if st.kl_type == "k1":
        kl, gk = -x, torch.ones_like(x)
    elif st.kl_type == "k2":
        kl, gk = 0.5 * x * x, -x
    else:
        x.clamp_(-K3_LOG_RATIO_MAX, K3_LOG_RATIO_MAX)
        em1 = torch.expm1(x)
        kl = em1 - x
        gk = torch.where(kl > K3_VALUE_MAX, 0.0, -em1)
        kl.clamp_(max=K3_VALUE_MAX)
    sums["kl_sum"] = (kl * valid.to(cdtype)).sum()
    if st.kl_coef == 0:
        return None
    kl_value = st.kl_coef * (w * kl).sum()
    sums["kl_loss"] = kl_value
    grad += (st.kl_coef * w) * gk
    return kl_value


def _entropy_bonus(entropy, w, valid, st: LossSettings, sums):
    """entropy_coeff times the weighted entropy (to subtract from the loss) and its gradient; (None, None) when
    the coefficient is 0 (only the mean entropy is reported)."""
    ent = entropy.detach().to(w.dtype).masked_fill(~valid, 0.0)
    sums["entropy_sum"] = ent.sum()
    if st.entropy_coeff == 0:
        return None, None
    ent_value = st.entropy_coeff * (w * ent).sum()
    sums["entropy_loss"] = ent_value
    return ent_value, -st.entropy_coeff * w


def _hinge_rows(d: torch.Tensor, wh: torch.Tensor, lens: torch.Tensor, delta: float):
    """Hinge value, (rows, phi'(d), weights) for the gradient, and metric sums, on rows with a positive hinge weight.

    With u = d - clamp(d, -delta, delta) (``softshrink``), s = sign(u) and t = e^{s delta} - 1 (0 inside the band):

        phi(d)  = e^{s delta} expm1(u) - u = (1 + t) expm1(u) - u       (the stable form of §6)
        phi'(d) = e^d - 1 = (1 + t) expm1(u) + t                         (exactly 0 inside the band)

    t = s (sinh(delta) + s (cosh(delta) - 1)) needs no transcendental, so the hinge costs one expm1 per token and no
    data-dependent branch (data-dependent where/masked_fill are slow on CPU).
    """
    zero = d.new_zeros(())
    on_row = wh.amax(dim=-1) > 0 if wh.numel() else torch.zeros(wh.shape[0], dtype=torch.bool, device=wh.device)
    rows = on_row.nonzero().flatten()
    n = rows.numel()
    if n == 0:
        sums = {"hinge_tokens": lens.new_zeros(()), "hinge_active": zero, "hinge_abs_d_sum": zero}
        return zero, None, sums
    if n == d.shape[0]:
        rows_idx = None
    else:
        rows_idx = rows
        d, wh = d.index_select(0, rows), wh.index_select(0, rows)
    cosh_m1 = 0.5 * (math.expm1(delta) + math.expm1(-delta))
    sinh = 0.5 * (math.expm1(delta) - math.expm1(-delta))
    u = torch.nn.functional.softshrink(d, delta)
    s = torch.sign(u)
    t = torch.addcmul(s * sinh, s, s, value=cosh_m1)  # e^{s delta} - 1
    e = torch.expm1(u)
    ke = torch.addcmul(e, e, t)  # e^{s delta} expm1(u)
    whf = wh.reshape(-1)
    value = torch.dot(whf, ke.reshape(-1)) - torch.dot(whf, u.reshape(-1))
    dphi = ke.add_(t)  # phi'(d)
    sums = {
        "hinge_tokens": lens.index_select(0, rows).sum(),
        "hinge_active": torch.dot(s.reshape(-1), s.reshape(-1)),  # s^2 is 1 exactly where |d| > delta
        "hinge_abs_d_sum": d.abs().sum(),
    }
    return value, (rows_idx, dphi, wh), sums
