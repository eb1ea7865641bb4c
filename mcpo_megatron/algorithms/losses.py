"""Policy losses: PPO/DAPO/GSPO surrogates, MCPO's hinge-KL, reference KL, TIS and the loss aggregation weights.

The loss of one optimizer step over mini-batch B is (MCPO Eq. 15, spec sections 1-2)

    L = L_PG + beta * L_HKL  (+ kl_coef * L_KL - entropy_coeff * H, both off in the paper),

and every term is a *sum* of per-token terms times a precomputed weight (``token_weights``) built from counts over
the whole mini-batch (all micro-batches, all data-parallel ranks). So the loss of a micro-batch is its share of the
mini-batch loss, and summing micro-batch losses and gradients gives the full-batch values whatever the split.

All terms are element-wise in ``logp``, so ``policy_loss`` computes the per-token gradient in the same pass as the
value (one fused no-grad pass) and hands it to autograd through ``_ElementwiseGrad``; this avoids storing a dozen
intermediates for the backward pass. Tests compare it with plain autograd references.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ._checks import check_choice
from .kl import k3

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
HINGE_AGGS = ("mastered", "batch")
KL_TYPES = ("k1", "k2", "k3")
RATIO_LEVELS = ("token", "sequence")

# verl clamps its k3 ("low_var_kl") value to [-10, 10]; the gradient is 0 where the clamp is active.
_K3_MAX = 10.0


def local_counts(response_mask: torch.Tensor, mastered: torch.Tensor) -> torch.Tensor:
    """float64 [3]: (tokens, non-empty sequences, non-empty mastered sequences) of this micro-batch on this rank.

    Sum these over micro-batches and all-reduce over data-parallel ranks to get the global counts that
    ``token_weights`` needs. Empty responses (|y| = 0) are excluded from the sequence counts N and |M_B|
    (spec section 3).
    """
    mask = _as_bool(response_mask, "response_mask")
    if mask.dim() != 2:
        raise ValueError(f"response_mask: expected [B, T], got shape {tuple(mask.shape)}.")
    lens = mask.sum(dim=-1)
    nonempty = lens > 0
    m = _check_mastered(mastered, mask.shape[0]) & nonempty
    return torch.stack([lens.sum(), nonempty.sum(), m.sum()]).to(torch.float64)


def token_weights(
    response_mask: torch.Tensor,
    mastered: torch.Tensor,
    *,
    loss_agg_mode: str,
    global_tokens,
    global_seqs,
    global_mastered,
    max_response_length: int | None = None,
    hinge_agg: str = "mastered",
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loss weights of a micro-batch from mini-batch-global counts (spec sections 1-2).

    Args:
        response_mask: [B, T] valid response tokens of this micro-batch.
        mastered: [B] bool, the sequence's group is mastered (``mastery.sequence_mastered``).
        loss_agg_mode: how L_PG averages per-token terms; N = non-empty sequences, |y_i| = length:
            ``token-mean`` w = 1/(global tokens) (DAPO Eq. 3); ``seq-mean-token-mean`` w = 1/(|y_i| N) (MCPO, spec
            default); ``seq-mean-token-sum`` w = 1/N; ``seq-mean-token-sum-norm`` w = 1/(L_max N) with
            L_max = ``max_response_length`` (Dr.GRPO: per-sequence token sums over a constant length, averaged over
            sequences. verl divides each micro-batch's token sum by L_max and then scales by its micro-batch share,
            which makes the result depend on the micro-batch size; this form does not).
        global_tokens, global_seqs, global_mastered: ``local_counts`` summed over the whole mini-batch.
        hinge_agg: ``mastered`` w = 1/(|y_i| |M_B|) on mastered sequences (Eq. 11 literally); ``batch`` uses N
            instead of |M_B|. If |M_B| = 0 the hinge weights are 0.
        dtype: dtype of the returned weights.

    Returns:
        (pg_weight [B, T], hkl_weight [B, T]), zero on padding and on empty responses.
    """
    check_choice("loss_agg_mode", loss_agg_mode, LOSS_AGG_MODES)
    check_choice("hinge_agg", hinge_agg, HINGE_AGGS)
    mask = _as_bool(response_mask, "response_mask")
    if mask.dim() != 2:
        raise ValueError(f"response_mask: expected [B, T], got shape {tuple(mask.shape)}.")
    m = _check_mastered(mastered, mask.shape[0])
    lens = mask.sum(dim=-1)
    m = m & (lens > 0)
    n_tok, n_seq, n_mas = (float(x) for x in (global_tokens, global_seqs, global_mastered))
    loc = local_counts(mask, m).tolist()
    for key, glob, local in (("global_tokens", n_tok, loc[0]), ("global_seqs", n_seq, loc[1]),
                             ("global_mastered", n_mas, loc[2])):
        if glob < local:
            raise ValueError(
                f"{key}={glob}: smaller than this micro-batch's own count {local}; pass local_counts summed over "
                f"all micro-batches and data-parallel ranks of the mini-batch."
            )
    maskf = mask.to(torch.float64)
    inv_len = 1.0 / lens.clamp(min=1).to(torch.float64)

    def per_seq(scale: torch.Tensor | float) -> torch.Tensor:
        return maskf * scale

    if loss_agg_mode == "token-mean":
        pg = per_seq(1.0 / n_tok if n_tok > 0 else 0.0)
    elif n_seq == 0:
        pg = torch.zeros_like(maskf)
    elif loss_agg_mode == "seq-mean-token-mean":
        pg = per_seq(inv_len[:, None] / n_seq)
    elif loss_agg_mode == "seq-mean-token-sum":
        pg = per_seq(1.0 / n_seq)
    else:
        if not (isinstance(max_response_length, int) and max_response_length > 0):
            raise ValueError(
                f"max_response_length={max_response_length!r}: seq-mean-token-sum-norm needs the configured "
                f"data.max_response_length (a positive int), not the padded width, so weights do not depend on "
                f"the micro-batch split."
            )
        pg = per_seq(1.0 / (max_response_length * n_seq))

    denom = n_mas if hinge_agg == "mastered" else n_seq
    if denom > 0:
        hk = maskf * (m.to(torch.float64) * inv_len)[:, None] / denom
    else:
        hk = torch.zeros_like(maskf)
    return pg.to(dtype), hk.to(dtype)


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


@dataclass(frozen=True)
class LossSettings:
    """The scalar settings of :func:`policy_loss` (validated here, so a bad value fails before any step).

    clip_low, clip_high: clip-higher widths, 0 < clip_low < 1, clip_high > 0.
    clip_c: dual-clip bound (> 1) for A < 0; None disables it.
    ratio_level: "token" (PPO) or "sequence" (GSPO).
    hinge_coef, hinge_delta: beta and delta of MCPO Eq. (10)/(15).
    log_ratio_clamp: the PG log-ratio d = logp - old_logp (and the TIS log-ratio old_logp - rollout_logp) is clamped
        to [-log_ratio_clamp, log_ratio_clamp] before exp; the PG gradient is 0 where the clamp is active.
    d_clamp: the same for the hinge's d (its own bound; the hinge gradient is 0 where it is active).
    kl_coef, kl_type: reference-policy KL penalty ``kl_coef * sum w kl`` (k1, k2 or k3; see policy_loss).
    tis_cap: truncated importance sampling cap (None: with rollout log-probs, only the mismatch metrics).
    entropy_coeff: entropy bonus weight.
    """

    clip_low: float = 0.2
    clip_high: float = 0.28
    clip_c: float | None = 10.0
    ratio_level: str = "token"
    hinge_coef: float = 1.0
    hinge_delta: float = 0.01
    log_ratio_clamp: float = 20.0
    d_clamp: float = 20.0
    kl_coef: float = 0.0
    kl_type: str = "k3"
    tis_cap: float | None = None
    entropy_coeff: float = 0.0

    def __post_init__(self):
        check_choice("ratio_level", self.ratio_level, RATIO_LEVELS)
        check_choice("kl_type", self.kl_type, KL_TYPES)
        if not 0 < self.clip_low < 1:
            raise ValueError(f"clip_low={self.clip_low!r}: must be in (0, 1).")
        if not self.clip_high > 0:
            raise ValueError(f"clip_high={self.clip_high!r}: must be > 0.")
        if self.clip_c is not None and not self.clip_c > 1:
            raise ValueError(
                f"clip_c={self.clip_c!r}: the dual-clip bound must be > 1, or None to disable it."
            )
        if not self.hinge_delta > 0:
            raise ValueError(f"hinge_delta={self.hinge_delta!r}: must be > 0.")
        if not self.log_ratio_clamp > 0:
            raise ValueError(f"log_ratio_clamp={self.log_ratio_clamp!r}: must be > 0.")
        if not self.d_clamp > 0:
            raise ValueError(f"d_clamp={self.d_clamp!r}: must be > 0.")
        if self.tis_cap is not None and not self.tis_cap > 0:
            raise ValueError(f"tis_cap={self.tis_cap!r}: needs rollout_logp and a cap > 0.")

    @classmethod
    def from_config(cls, a) -> "LossSettings":
        """From the ``algorithm`` config section: a disabled reference KL has coefficient 0, disabled TIS no cap."""
        h = a.mcpo.hinge_kl
        return cls(clip_low=a.clip_ratio_low, clip_high=a.clip_ratio_high, clip_c=a.clip_ratio_c,
                   ratio_level=a.ratio_level, hinge_coef=h.coef, hinge_delta=h.delta,
                   log_ratio_clamp=a.log_ratio_clamp, d_clamp=h.d_clamp,
                   kl_coef=a.kl.coef if a.kl.enable else 0.0, kl_type=a.kl.type,
                   tis_cap=a.tis.cap if a.tis.enable else None, entropy_coeff=a.entropy_coeff)


DEFAULT_SETTINGS = LossSettings()


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    pg_weight: torch.Tensor,
    mask: torch.Tensor,
    settings: LossSettings = DEFAULT_SETTINGS,
    *,
    hkl_weight: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    rollout_logp: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss of one micro-batch: weighted sum of per-token PG, hinge-KL, reference-KL and entropy terms.

    PG term (MCPO Eq. 3/15, clip-higher of DAPO, dual clip of verl): with r the importance ratio and A the advantage,
    ``l = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))`` and, for A < 0, ``min(l, -A clip_c)``. This equals
    ``-A * clamp(r, lo, hi)`` with (lo, hi) = (0, 1 + clip_high) for A > 0 and (1 - clip_low, clip_c) for A < 0; the
    gradient is ``-A r`` where the clamp is inactive and 0 where it is active.

    ``ratio_level="sequence"`` is GSPO: s_i = exp(mean_t d_it) over the sequence's valid tokens, in GSPO-token's
    straight-through form (log s_it = sg[log s_i] + logp_t - sg[logp_t]), so the value and clipping are per
    sequence and d loss / d logp_t = -A_i s_i w_t when unclipped. Use seq-mean-token-mean weights with it (spec
    section 4; GSPO's own clip widths 3e-4/4e-4); dual clip still applies when ``clip_c`` is set.

    Args:
        logp: [B, T] current log-probs of the response tokens (requires grad).
        old_logp: [B, T] trainer-recomputed log-probs at the start of the global step (PPO denominator and hinge
            anchor; never the rollout engine's log-probs, spec section 2).
        advantages: [B] (broadcast over tokens) or [B, T]; must be finite, padding included.
        pg_weight: [B, T] from ``token_weights``; 0 on padding.
        mask: [B, T] valid response tokens.
        settings: the scalar settings (:class:`LossSettings`).
        hkl_weight: [B, T] hinge weights from ``token_weights`` (0 off mastered sequences); None disables the hinge.
        ref_logp: [B, T] reference log-probs for the KL penalty ``kl_coef * sum w kl`` with w = pg_weight;
            k1 = logp - ref, k2 = (logp - ref)^2 / 2, k3 = e^x - x - 1 with x = ref - logp clamped to [-20, 20]
            and the value clamped at 10 (verl ``low_var_kl``).
        rollout_logp: [B, T] the engine's log-probs: truncated importance sampling multiplies each token's PG term
            by the detached weight ``min(exp(old_logp - rollout_logp), tis_cap)``; without a cap only the
            train/inference mismatch metrics are computed.
        entropy: [B, T] for the bonus ``- entropy_coeff * sum w H`` (gradient flows into ``entropy``).

    Returns:
        ``(loss, metric_sums)``: loss is a 0-d tensor; metric_sums maps names to 0-d tensors (int64 counts,
        floating sums) that compose by addition over micro-batches and ranks (see ``METRIC_SUM_KEYS``);
        ``finalize_metrics`` turns them into means. Computation is in float32, or float64 for float64 input.
    """
    st = settings
    _check_inputs(logp, old_logp, advantages, pg_weight, mask, st, hkl_weight=hkl_weight, ref_logp=ref_logp,
                  rollout_logp=rollout_logp, entropy=entropy)
    cdtype = torch.promote_types(logp.dtype, torch.float32)
    sums: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        valid = _as_bool(mask, "mask")
        lens = valid.sum(dim=-1)
        d, d_hinge, saturated, hinge_saturated = _log_ratios(logp, old_logp, valid, st, hinge=hkl_weight is not None)
        adv = advantages.to(cdtype)
        if adv.dim() == 1:
            adv = adv[:, None]
        loss, grad = _clipped_pg(d, adv, pg_weight.to(cdtype), valid, lens, saturated, st, sums,
                                 old_logp=old_logp, rollout_logp=rollout_logp)
        if hkl_weight is not None:
            loss = loss + _add_hinge(d_hinge, hinge_saturated, hkl_weight.to(cdtype), lens, grad, st, sums)
        if ref_logp is not None:
            kl_value = _add_reference_kl(logp, ref_logp, pg_weight.to(cdtype), valid, grad, st, sums)
            loss = loss + kl_value if kl_value is not None else loss
        grad_entropy = None
        if entropy is not None:
            bonus, grad_entropy = _entropy_bonus(entropy, pg_weight.to(cdtype), valid, st, sums)
            loss = loss - bonus if bonus is not None else loss
        sums["loss"] = loss

    out = _ElementwiseGrad.apply(loss, logp, grad, entropy if grad_entropy is not None else None, grad_entropy)
    return out, sums


def _check_inputs(logp, old_logp, advantages, pg_weight, mask, st: LossSettings, **optional) -> None:
    """Tensor shapes, and the settings that need a tensor the caller did not pass."""
    if st.kl_coef != 0 and optional["ref_logp"] is None:
        raise ValueError(f"kl_coef={st.kl_coef!r} needs ref_logp; pass the reference log-probs or set kl_coef=0.")
    if st.entropy_coeff != 0 and optional["entropy"] is None:
        raise ValueError(f"entropy_coeff={st.entropy_coeff!r} needs entropy; pass it or set entropy_coeff=0.")
    if st.tis_cap is not None and optional["rollout_logp"] is None:
        raise ValueError(f"tis_cap={st.tis_cap!r}: needs rollout_logp and a cap > 0.")
    if logp.dim() != 2:
        raise ValueError(f"logp: expected [B, T], got shape {tuple(logp.shape)}.")
    shape = logp.shape
    for name, t in (("old_logp", old_logp), ("pg_weight", pg_weight), ("mask", mask), *optional.items()):
        if t is not None and t.shape != shape:
            raise ValueError(f"{name}: shape {tuple(t.shape)} must equal logp's {tuple(shape)}.")
    if advantages.shape not in (shape, shape[:1]):
        raise ValueError(f"advantages: shape {tuple(advantages.shape)} must be [B]={tuple(shape[:1])} or [B, T].")


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


def _clipped_pg(d, adv, pg_w, valid, lens, saturated, st: LossSettings, sums, *, old_logp, rollout_logp):
    """The PG term -w A clamp(r, lo, hi) (times the TIS weight): its value and per-token gradient d/dlogp, and
    the clip, ratio and mismatch metric sums."""
    cdtype = d.dtype
    maskf = valid.to(cdtype)
    tokens = lens.sum()
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
    neg_weighted_adv = pg_w * adv  # becomes -w A (times the TIS weight)
    neg_weighted_adv.neg_()
    if rollout_logp is not None:
        x = (old_logp.to(cdtype) - rollout_logp.to(cdtype)).masked_fill_(~valid, 0.0)
        x.clamp_(-st.log_ratio_clamp, st.log_ratio_clamp)
        sums["mismatch_abs_sum"] = x.abs().sum()
        sums["mismatch_k3_sum"] = k3(x).sum()  # x = log p_trainer - log p_engine: KL(engine || trainer)
        if st.tis_cap is not None:
            raw = torch.exp(x)
            tis = raw.clamp(max=st.tis_cap)
            sums["tis_sum"] = (tis * maskf).sum()
            sums["tis_capped"] = ((raw > st.tis_cap) & valid).sum()
            neg_weighted_adv.mul_(tis)
    pg_value = (neg_weighted_adv * r_eff).sum()
    # which bound is active: +1 the lower, -1 the upper (clip-higher or dual), 0 none; clipped = its square
    clip_side = torch.sign(r_eff - r)
    clipped = clip_side * clip_side
    grad = neg_weighted_adv * (r * (1.0 - clipped))  # -w A r where unclipped (straight-through for GSPO)
    if saturated is not None:
        grad.masked_fill_(saturated, 0.0)
    _count_clipping(clip_side, clipped, posf, negf, lens, maskf, st, sums, per_row=adv.shape[-1] == 1)
    sums["ratio_sum"] = (r.sum() - (valid.numel() - tokens) if st.ratio_level == "token"
                         else (r[:, 0] * lens).sum())
    sums["ppo_kl_sum"] = -d.sum()
    sums["pg_loss"] = pg_value
    return pg_value, grad


def _count_clipping(clip_side, clipped, posf, negf, lens, maskf, st: LossSettings, sums, *, per_row: bool) -> None:
    """Token counts of each active clip bound: clip-higher (A > 0), dual clip (A < 0, upper) and the lower
    bound (A < 0); a sequence-level ratio counts its sequence's tokens."""
    if st.ratio_level == "sequence":
        if clip_side.shape[-1] == 1:  # per-sequence clip: count its tokens
            clip_side, clipped = clip_side * lens[:, None], clipped * lens[:, None]
        else:
            clip_side, clipped = clip_side * maskf, clipped * maskf
    elif per_row:  # reduce per row first, then weight by the row's advantage sign
        clip_side, clipped = clip_side.sum(dim=-1, keepdim=True), clipped.sum(dim=-1, keepdim=True)
    upper, lower = 0.5 * (clipped - clip_side), 0.5 * (clipped + clip_side)
    sums["tokens"] = lens.sum()
    sums["seqs"] = (lens > 0).sum()
    sums["pg_clipped_high"] = (posf * upper).sum()
    sums["dual_clipped"] = (negf * upper).sum()
    sums["pg_clipped_low"] = (negf * lower).sum()


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
        x.clamp_(-20.0, 20.0)
        em1 = torch.expm1(x)
        kl = em1 - x
        gk = torch.where(kl > _K3_MAX, 0.0, -em1)
        kl.clamp_(max=_K3_MAX)
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

        phi(d)  = e^{s delta} expm1(u) - u = (1 + t) expm1(u) - u       (spec's stable form, section 2)
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

METRIC_SUM_KEYS = {
    "tokens": "valid response tokens",
    "seqs": "non-empty sequences",
    "pg_loss": "weighted PG loss (its share of L_PG)",
    "pg_clipped_high": "tokens with A > 0 and r > 1 + clip_high (upper clip active)",
    "pg_clipped_low": "tokens with A < 0 and r < 1 - clip_low (lower clip active)",
    "dual_clipped": "tokens with A < 0 and r > clip_c (dual clip active)",
    "ratio_sum": "sum of the importance ratio r over valid tokens",
    "ppo_kl_sum": "sum of old_logp - logp over valid tokens (clamped)",
    "hinge_tokens": "tokens of mastered sequences (hinge weight > 0)",
    "hinge_active": "mastered tokens with |d| > delta (hinge active)",
    "hinge_abs_d_sum": "sum of |d| over mastered tokens",
    "hinge_value": "weighted hinge sum (its share of L_HKL, without beta)",
    "hkl_loss": "beta * hinge_value",
    "kl_sum": "sum of the reference KL estimate over valid tokens",
    "kl_loss": "kl_coef * weighted KL",
    "entropy_sum": "sum of the entropy over valid tokens",
    "entropy_loss": "entropy_coeff * weighted entropy (subtracted from the loss)",
    "mismatch_abs_sum": "sum of |old_logp - rollout_logp| over valid tokens",
    "mismatch_k3_sum": "sum of the k3 estimate of KL(engine || trainer) over valid tokens",
    "tis_sum": "sum of the truncated IS weight over valid tokens",
    "tis_capped": "tokens whose IS weight hit tis_cap",
    "loss": "the micro-batch loss",
}

FINAL_METRIC_KEYS = {
    "actor/loss": "total loss (sum of micro-batch losses)",
    "actor/pg_loss": "L_PG",
    "actor/pg_clipfrac": "fraction of tokens whose PPO clip is active (low + high)",
    "actor/pg_clipfrac_high": "fraction with the upper (clip-higher) bound active",
    "actor/pg_clipfrac_low": "fraction with the lower bound active",
    "actor/pg_clipfrac_dual": "fraction with the dual clip active",
    "actor/ratio_mean": "mean importance ratio",
    "actor/ppo_kl": "mean old_logp - logp",
    "hkl/loss": "beta * L_HKL",
    "hkl/value": "L_HKL",
    "hkl/active_frac": "fraction of mastered tokens with |d| > delta",
    "hkl/mean_abs_d": "mean |d| over mastered tokens",
    "hkl/mastered_token_frac": "fraction of tokens that belong to mastered sequences",
    "actor/kl_mean": "mean reference KL per token",
    "actor/kl_loss": "kl_coef * weighted KL",
    "actor/entropy": "mean entropy per token",
    "actor/entropy_loss": "entropy_coeff * weighted entropy",
    "rollout/mismatch_abs_mean": "mean |old_logp - rollout_logp|",
    "rollout/mismatch_k3": "mean k3 estimate of KL(engine || trainer) (algorithms.kl.k3)",
    "tis/mean": "mean truncated IS weight",
    "tis/capped_frac": "fraction of tokens whose IS weight was capped",
}


def finalize_metrics(sums: dict) -> dict[str, float]:
    """Turn metric sums (added over micro-batches and ranks) into the means and fractions of ``FINAL_METRIC_KEYS``.

    Keys whose sources are absent are left out; a fraction over zero tokens is 0.
    """
    s = {k: float(v) for k, v in sums.items()}

    def frac(num, den):
        return s[num] / s[den] if s.get(den, 0.0) > 0 else 0.0

    out: dict[str, float] = {}
    for src, dst in (("loss", "actor/loss"), ("pg_loss", "actor/pg_loss"), ("hkl_loss", "hkl/loss"),
                     ("hinge_value", "hkl/value"), ("kl_loss", "actor/kl_loss"),
                     ("entropy_loss", "actor/entropy_loss")):
        if src in s:
            out[dst] = s[src]
    if "tokens" in s:
        out["actor/pg_clipfrac"] = frac("pg_clipped_high", "tokens") + frac("pg_clipped_low", "tokens")
        out["actor/pg_clipfrac_high"] = frac("pg_clipped_high", "tokens")
        out["actor/pg_clipfrac_low"] = frac("pg_clipped_low", "tokens")
        out["actor/pg_clipfrac_dual"] = frac("dual_clipped", "tokens")
        out["actor/ratio_mean"] = frac("ratio_sum", "tokens")
        out["actor/ppo_kl"] = frac("ppo_kl_sum", "tokens")
        for src, dst in (("kl_sum", "actor/kl_mean"), ("entropy_sum", "actor/entropy"),
                         ("mismatch_abs_sum", "rollout/mismatch_abs_mean"), ("mismatch_k3_sum", "rollout/mismatch_k3"),
                         ("tis_sum", "tis/mean"), ("tis_capped", "tis/capped_frac")):
            if src in s:
                out[dst] = frac(src, "tokens")
    if "hinge_tokens" in s:
        out["hkl/active_frac"] = frac("hinge_active", "hinge_tokens")
        out["hkl/mean_abs_d"] = frac("hinge_abs_d_sum", "hinge_tokens")
        out["hkl/mastered_token_frac"] = frac("hinge_tokens", "tokens")
    return out


def _as_bool(x: torch.Tensor, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}: expected a tensor, got {type(x).__name__}.")
    return x if x.dtype == torch.bool else x != 0


def _check_mastered(mastered, batch: int) -> torch.Tensor:
    m = torch.as_tensor(mastered)
    if m.shape != (batch,):
        raise ValueError(f"mastered: expected shape [{batch}] (one flag per sequence), got {tuple(m.shape)}.")
    return m if m.dtype == torch.bool else m != 0
