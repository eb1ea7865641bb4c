"""The policy loss as defined: plain torch ops, one function per term, gradients by autograd (docs/algorithms.md).

For one micro-batch, with the weights w (``pg_weight``) and h (``hkl_weight``) of ``aggregation.token_weights``
(docs/algorithms.md §4), summed over its valid tokens (i, t):

    L =   sum w_it * tis_it * m_it * l(r_it, A_i)   clipped surrogate, MCPO Eq. (3) in Eq. (15)   §5, TIS, masks §8
        + beta * sum h_it * phi(d_it)                hinge-KL, MCPO Eq. (10)-(11) in Eq. (15)       §6
        + kl_coef * sum w_it * k(x_it)               reference KL (off in every preset)            §7
        - entropy_coeff * sum w_it * H_it            entropy bonus (off in every preset)           §7

with d = logp - old_logp, r = e^d (or GSPO's sequence ratio), x = ref_logp - logp. Training calls the fused
``losses.policy_loss``, which computes the same values with hand-derived gradients (docs/algorithms.md §15 says
why); this module is the definition it is tested against, and the one to read.
"""

from __future__ import annotations

import math

import torch

from ._checks import as_bool
from .kl import k3
from .loss_settings import DEFAULT_SETTINGS, K3_LOG_RATIO_MAX, K3_VALUE_MAX, LossInputs, LossSettings


def literal_policy_loss(inputs: LossInputs, settings: LossSettings = DEFAULT_SETTINGS,
                        ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss of one micro-batch and its metric sums; arguments and results as ``losses.policy_loss``.

    In the notation above: ``inputs.logp`` is log pi_theta, ``old_logp`` log pi_old (the trainer's recomputation at
    the start of the global step), ``advantages`` A_i, ``pg_weight`` and ``hkl_weight`` w and h (no hinge-KL without
    h), ``ref_logp`` log pi_ref, ``rollout_logp`` log mu (the engine's log-probs, for TIS and the mismatch
    metrics), ``entropy`` H, ``behaviour_mask`` m (the 0/1 token and sequence masks of §8).

    Returns:
        ``(loss, metric_sums)`` (``loss_metrics.METRIC_SUM_KEYS``). Computed in float32, or float64 for float64
        input.
    """
    st, x = settings, inputs
    x.check(st)
    dtype = torch.promote_types(x.logp.dtype, torch.float32)
    valid = as_bool(x.mask, "mask")
    w = x.pg_weight.to(dtype)
    logp = x.logp.to(dtype)
    d = on_tokens(valid, logp - x.old_logp.to(dtype))

    loss, sums = _pg_loss(d, w, x, valid, st)  # L_PG (§5), with TIS and the masks (§8)
    if x.hkl_weight is not None:  # beta L_HKL (§6)
        h = x.hkl_weight.to(dtype)
        d_hinge = d.clamp(-st.d_clamp, st.d_clamp)
        hinge = (h * hinge_phi(d_hinge, st.hinge_delta)).sum()
        loss = loss + st.hinge_coef * hinge
        sums.update(hinge_sums(d_hinge, h, valid, st.hinge_delta))
        sums["hinge_value"], sums["hkl_loss"] = hinge.detach(), (st.hinge_coef * hinge).detach()
    if x.ref_logp is not None:  # the reference KL (§7); with kl_coef 0 only its metric
        kl = reference_kl(on_tokens(valid, x.ref_logp.to(dtype) - logp), st.kl_type)
        sums["kl_sum"] = on_tokens(valid, kl).detach().sum()
        if st.kl_coef != 0:
            kl_loss = st.kl_coef * (w * kl).sum()
            loss = loss + kl_loss
            sums["kl_loss"] = kl_loss.detach()
    if x.entropy is not None:  # the entropy bonus (§7); with entropy_coeff 0 only its metric
        ent = on_tokens(valid, x.entropy.to(dtype))
        sums["entropy_sum"] = ent.detach().sum()
        if st.entropy_coeff != 0:
            bonus = st.entropy_coeff * (w * ent).sum()
            loss = loss - bonus
            sums["entropy_loss"] = bonus.detach()
    sums["loss"] = loss.detach()
    return loss, sums


def _pg_loss(d: torch.Tensor, w: torch.Tensor, x: LossInputs, valid: torch.Tensor, st: LossSettings):
    """L_PG = sum w tis m l(r, A): the clipped surrogate (§5), each token's term times its TIS weight when on and
    its behaviour mask (§8); and its clip, ratio, mismatch and TIS metric sums."""
    dtype = d.dtype
    adv = x.advantages.to(dtype)
    adv = (adv[:, None] if adv.dim() == 1 else adv).expand(valid.shape)
    pg_d = d.clamp(-st.log_ratio_clamp, st.log_ratio_clamp)
    r = importance_ratio(pg_d, valid, st.ratio_level, st.log_ratio_clamp)
    terms = clipped_surrogate(r, adv, st.clip_low, st.clip_high, st.clip_c)
    sums = clip_metric_sums(r, adv, pg_d, valid, st)
    if x.rollout_logp is not None:
        log_mu_ratio = on_tokens(valid, x.old_logp.to(dtype) - x.rollout_logp.to(dtype))
        log_mu_ratio = log_mu_ratio.clamp(-st.log_ratio_clamp, st.log_ratio_clamp)
        sums.update(mismatch_sums(log_mu_ratio, valid))
        if st.tis_cap is not None:
            tis = tis_weight(log_mu_ratio, st.tis_cap)
            sums.update(tis_sums(log_mu_ratio, tis, valid, st.tis_cap))
            terms = terms * tis
    if x.behaviour_mask is not None:  # the token and sequence masks (§8): no PG term where 0
        terms = terms * x.behaviour_mask.to(dtype)
    loss = (w * terms).sum()
    sums["pg_loss"] = loss.detach()
    return loss, sums


def on_tokens(valid: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``x`` on valid tokens, 0 on padding (whatever the padding holds, inf and NaN included, and no gradient)."""
    return torch.where(valid, x, torch.zeros((), dtype=x.dtype, device=x.device))


def importance_ratio(d: torch.Tensor, valid: torch.Tensor, ratio_level: str, log_ratio_clamp: float) -> torch.Tensor:
    """[B, T] importance ratio of each token from the (clamped) log-ratio d = log pi_theta - log pi_old (§5).

    ``token`` (PPO): r_it = e^{d_it}. ``sequence`` (GSPO): s_i = exp(mean_t d_it) over the sequence's valid tokens,
    in GSPO-token's straight-through form s_it = sg[s_i] * pi_theta(y_t) / sg[pi_theta(y_t)]: every token carries the
    value s_i, and the gradient of s_it with respect to log pi_theta(y_t) is s_i.
    """
    if ratio_level == "token":
        return torch.exp(d)
    lengths = valid.sum(dim=-1, keepdim=True).clamp(min=1)
    s = torch.exp((d.sum(dim=-1, keepdim=True) / lengths).clamp(-log_ratio_clamp, log_ratio_clamp))
    return s.detach() * torch.exp(d - d.detach())


def clipped_surrogate(r: torch.Tensor, adv: torch.Tensor, clip_low: float, clip_high: float,
                      clip_c: float | None) -> torch.Tensor:
    """Per-token PG loss l = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)) (PPO's clipped surrogate with DAPO's
    clip-higher), and where A < 0 at most -A c (dual clip), c = ``clip_c`` (§5)."""
    term = torch.maximum(-adv * r, -adv * torch.clamp(r, 1.0 - clip_low, 1.0 + clip_high))
    if clip_c is None:
        return term
    return torch.where(adv < 0, torch.minimum(term, -adv * clip_c), term)


def tis_weight(log_mu_ratio: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance sampling weight min(pi_old / mu, C) from log(pi_old / mu) (§8); it carries no gradient."""
    return torch.exp(log_mu_ratio).clamp(max=cap)


def hinge_phi(d: torch.Tensor, delta: float) -> torch.Tensor:
    """MCPO's hinge phi(d) of Eq. (10): 0 inside the band |d| <= delta, k3(d) - k3(+-delta) outside (§6).

    k3(x) = e^x - x - 1; outside the band each branch is written as k3(d) - k3(+delta) = e^delta expm1(d - delta) -
    (d - delta) (likewise at -delta), the same number without the cancellation of e^d - d - 1 near d = 0 (in fp32
    the direct difference loses about 3 of its 7 digits at d = 0.0105). Its derivative is e^d - 1 outside the
    band and 0 inside.
    """
    above = math.exp(delta) * torch.expm1(d - delta) - (d - delta)
    below = math.exp(-delta) * torch.expm1(d + delta) - (d + delta)
    return torch.where(d > delta, above, torch.where(d < -delta, below, torch.zeros_like(d)))


def reference_kl(x: torch.Tensor, kl_type: str) -> torch.Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) from x = log pi_ref - log pi_theta at the sampled tokens (§7):
    k1 = -x, k2 = x^2 / 2, k3 = e^x - x - 1 (the log-ratio and value clamped as verl's ``low_var_kl``)."""
    if kl_type == "k1":
        return -x
    if kl_type == "k2":
        return 0.5 * x * x
    x = x.clamp(-K3_LOG_RATIO_MAX, K3_LOG_RATIO_MAX)
    return k3(x).clamp(max=K3_VALUE_MAX)


def clip_metric_sums(r, adv, d, valid, st: LossSettings) -> dict[str, torch.Tensor]:
    """Token counts of each active clip bound, and the sums of r and -d, over valid tokens."""
    with torch.no_grad():
        pos, neg = valid & (adv > 0), valid & (adv < 0)
        dual = neg & (r > st.clip_c) if st.clip_c is not None else torch.zeros_like(valid)
        return {
            "tokens": valid.sum(),
            "seqs": (valid.sum(dim=-1) > 0).sum(),
            "pg_clipped_high": (pos & (r > 1.0 + st.clip_high)).sum(),
            "pg_clipped_low": (neg & (r < 1.0 - st.clip_low)).sum(),
            "dual_clipped": dual.sum(),
            "ratio_sum": on_tokens(valid, r).sum(),
            "ppo_kl_sum": -d.sum(),
        }


def mismatch_sums(log_mu_ratio: torch.Tensor, valid: torch.Tensor) -> dict[str, torch.Tensor]:
    """Train/inference mismatch: sums of |log pi_old - log mu| and of k3, whose mean estimates KL(mu || pi_old)."""
    with torch.no_grad():
        return {"mismatch_abs_sum": log_mu_ratio.abs().sum(),
                "mismatch_k3_sum": on_tokens(valid, k3(log_mu_ratio)).sum()}


def tis_sums(log_mu_ratio, tis, valid, cap: float) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        return {"tis_sum": on_tokens(valid, tis).sum(), "tis_capped": (valid & (torch.exp(log_mu_ratio) > cap)).sum()}


def hinge_sums(d, h, valid, delta: float) -> dict[str, torch.Tensor]:
    """Over the tokens of sequences with a hinge weight (mastered): their count, how many have |d| > delta, sum |d|."""
    with torch.no_grad():
        on_row = (h > 0).any(dim=-1, keepdim=True) & valid
        return {"hinge_tokens": on_row.sum(), "hinge_active": (on_row & (d.abs() > delta)).sum(),
                "hinge_abs_d_sum": on_tokens(on_row, d.abs()).sum()}
