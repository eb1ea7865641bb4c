"""Group-relative advantages: GRPO, Dr.GRPO and MCPO's mastery reweighting.

MCPO paper Eq. (12)-(14) (docs/algorithms.md §3):

    A_i = (R_i - mean R) / ((std R + eps) * scale(p)),   p = mean(acc) over the group,
    scale(p) = 2 * sqrt(p (1 - p))  if threshold < p < 1,  else 1.

With binary rewards GRPO gives a query the weight W(x) = sqrt(p(1-p)) (see ``mastery.query_weight``); dividing
by scale(p) fixes W(x) = 1/2 on majority-correct groups, so they are no longer down-weighted as p -> 1.
"""

from __future__ import annotations

import torch

from ._checks import as_1d, check_binary, check_choice, check_group_layout

ESTIMATORS = ("grpo", "drgrpo", "mcpo")
STD_MODES = ("unbiased", "population")


def mcpo_scale(p: torch.Tensor, *, threshold: float = 0.5) -> torch.Tensor:
    """MCPO's reweighting divisor scale(p) of Eq. (13).

    ``2*sqrt(p(1-p))`` for ``threshold < p < 1`` and 1 elsewhere. p = 1 would give 0, so it keeps scale 1
    (docs/algorithms.md §3: a mastered group with std > 0 from overlong shaping keeps its baseline advantages).
    MCPO reweights GRPO's advantages only: the config refuses ``algorithm.mcpo.reweight`` with drgrpo.
    """
    p = torch.as_tensor(p, dtype=torch.float64)
    raw = 2.0 * torch.sqrt((p * (1.0 - p)).clamp(min=0.0))
    active = (p > threshold) & (p < 1.0)
    return torch.where(active, raw, torch.ones_like(p))


def group_advantages(
    rewards,
    correct,
    group_size: int,
    *,
    estimator: str,
    std_mode: str = "unbiased",
    eps: float = 1e-6,
    threshold: float = 0.5,
) -> torch.Tensor:
    """Per-response advantages, one group of ``group_size`` responses per prompt, groups laid out one after another.

    Args:
        rewards: [num_groups * group_size] shaped rewards (score plus overlong penalty). Must be finite: a NaN
            or verifier timeout must already be scored (acc=0, score=-1) by the reward layer.
        correct: same shape, the verifier's binary acc (0/1). MCPO's p(x) comes from it, never from ``rewards``.
            Empty responses (|y| = 0) are ordinary entries here: they count in p.
        group_size: responses per prompt (rollout.n).
        estimator: ``"grpo"`` (R - mean)/(std + eps); ``"drgrpo"`` R - mean (Dr.GRPO, no std);
            ``"mcpo"`` GRPO divided by ``mcpo_scale(p)`` (Eq. 12-14).
        std_mode: ``"unbiased"`` (ddof=1, verl's default and ours) or ``"population"`` (ddof=0, as in the
            paper's proof A.3). Ignored by drgrpo.
        eps: added to the std (verl), 1e-6.
        threshold: MCPO's majority threshold; scale applies for threshold < p < 1.

    Returns:
        Advantages with the shape of ``rewards``, in its floating dtype (float32 for integer input); computed in
        float64. Edge cases (docs/algorithms.md §3): a group whose rewards are all equal (std = 0, e.g. all wrong and
        unshaped) gets exactly A = 0; singleton groups (group_size = 1) get A = 0, not verl's raw score.
    """
    check_choice("estimator", estimator, ESTIMATORS)
    check_choice("std_mode", std_mode, STD_MODES)
    if not eps >= 0.0:
        raise ValueError(f"eps={eps!r}: must be >= 0 (default 1e-6).")
    if not 0.0 <= threshold < 1.0:
        raise ValueError(f"threshold={threshold!r}: must be in [0, 1) (default 0.5).")
    r = as_1d("rewards", rewards)
    c = as_1d("correct", correct)
    if r.shape != c.shape:
        raise ValueError(f"rewards has shape {tuple(r.shape)} but correct has {tuple(c.shape)}; they must match.")
    num_groups = check_group_layout("rewards", r, group_size)
    out_dtype = r.dtype if r.is_floating_point() else torch.float32
    r64 = r.to(torch.float64)
    if not bool(torch.isfinite(r64).all()):
        i = int((~torch.isfinite(r64)).nonzero()[0, 0])
        raise ValueError(
            f"rewards[{i}]={r64[i].item()!r}: must be finite; score NaN/timeouts as acc=0, score=-1 before "
            f"computing advantages (docs/algorithms.md §3)."
        )
    c64 = check_binary("correct", c)
    if group_size == 1 or num_groups == 0:
        return torch.zeros_like(r64).to(out_dtype)

    rg = r64.view(num_groups, group_size)
    centred = rg - rg.mean(dim=1, keepdim=True)
    # Identical rewards must give exactly 0; the float mean of equal values can be off by an ulp.
    flat = rg.amax(dim=1, keepdim=True) == rg.amin(dim=1, keepdim=True)
    if estimator == "drgrpo":
        adv = centred
    else:
        std = rg.std(dim=1, keepdim=True, unbiased=(std_mode == "unbiased"))
        adv = centred / (std + eps)
    if estimator == "mcpo":
        p = c64.view(num_groups, group_size).mean(dim=1, keepdim=True)
        adv = adv / mcpo_scale(p, threshold=threshold)
    adv = torch.where(flat, torch.zeros_like(adv), adv).reshape(-1)
    if not bool(torch.isfinite(adv).all()):
        raise FloatingPointError("group_advantages produced non-finite advantages; check eps > 0 and the rewards.")
    return adv.to(out_dtype)
