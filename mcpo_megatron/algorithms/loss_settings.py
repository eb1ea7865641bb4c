"""The arguments of the policy loss, shared by both implementations (``literal_loss.literal_policy_loss`` and
``losses.policy_loss``; docs/algorithms.md §15): its scalar settings and its per-token tensors, each checked."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from ._checks import check_choice

KL_TYPES = ("k1", "k2", "k3")
RATIO_LEVELS = ("token", "sequence")

# Overflow guard of the k3 reference KL, as verl's ``low_var_kl``: the log-ratio is clamped to [-20, 20] and the
# value to at most 10; no gradient where either clamp acts.
K3_LOG_RATIO_MAX = 20.0
K3_VALUE_MAX = 10.0


@dataclass(frozen=True)
class LossSettings:
    """The scalar settings of the policy loss (validated here, so a bad value fails before any step).

    Each field is named after the symbol of docs/algorithms.md; ``from_config`` maps the config keys onto them.

    clip_low, clip_high: clip-higher widths eps_low, eps_high, 0 < clip_low < 1, clip_high > 0 (§5).
    clip_c: dual-clip bound c (> 1) for A < 0; None disables it (§5).
    ratio_level: "token" (PPO) or "sequence" (GSPO) (§5).
    hinge_coef, hinge_delta: beta and delta of MCPO Eq. (10)/(15) (§6).
    log_ratio_clamp: the PG log-ratio d = logp - old_logp (and the TIS log-ratio old_logp - rollout_logp) is clamped
        to [-log_ratio_clamp, log_ratio_clamp] before exp; the PG gradient is 0 where the clamp is active.
    d_clamp: the same for the hinge's d (its own bound; the hinge gradient is 0 where it is active).
    kl_coef, kl_type: reference-policy KL penalty ``kl_coef * sum w kl`` with the k1, k2 or k3 estimator (§7).
    tis_cap: truncated importance sampling cap C (None: with rollout log-probs, only the mismatch metrics) (§8).
    entropy_coeff: entropy bonus weight (§7).
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


@dataclass(frozen=True)
class LossInputs:
    """The per-token tensors of one micro-batch's loss, as both implementations take them (docs/algorithms.md §4-§8).

    logp: [B, T] current log-probs of the response tokens (the gradient flows into it).
    old_logp: [B, T] trainer-recomputed log-probs at the start of the global step (PPO denominator and hinge
        anchor; never the rollout engine's log-probs, §6).
    advantages: [B] (broadcast over tokens) or [B, T]; must be finite, padding included.
    pg_weight: [B, T] w from ``aggregation.token_weights``; 0 on padding.
    mask: [B, T] valid response tokens.
    hkl_weight: [B, T] hinge weights h from ``token_weights`` (0 off mastered sequences); None: no hinge-KL.
    ref_logp: [B, T] reference log-probs for the KL penalty (§7); None: no reference KL.
    rollout_logp: [B, T] the engine's log-probs, for TIS and the train/inference mismatch metrics (§8).
    entropy: [B, T] per-token entropy for the bonus (the gradient flows into it, §7).
    behaviour_mask: [B, T] 0/1 from ``off_policy.behaviour_mask`` (token and sequence masks, §8); None: no mask.
    """

    logp: torch.Tensor
    old_logp: torch.Tensor
    advantages: torch.Tensor
    pg_weight: torch.Tensor
    mask: torch.Tensor
    hkl_weight: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None
    rollout_logp: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    behaviour_mask: torch.Tensor | None = None

    def check(self, st: LossSettings) -> None:
        """Tensor shapes, and the settings that need a tensor that was not passed."""
        if st.kl_coef != 0 and self.ref_logp is None:
            raise ValueError(f"kl_coef={st.kl_coef!r} needs ref_logp; pass the reference log-probs or set kl_coef=0.")
        if st.entropy_coeff != 0 and self.entropy is None:
            raise ValueError(f"entropy_coeff={st.entropy_coeff!r} needs entropy; pass it or set entropy_coeff=0.")
        if st.tis_cap is not None and self.rollout_logp is None:
            raise ValueError(f"tis_cap={st.tis_cap!r}: needs rollout_logp and a cap > 0.")
        if self.logp.dim() != 2:
            raise ValueError(f"logp: expected [B, T], got shape {tuple(self.logp.shape)}.")
        shape = self.logp.shape
        for f in fields(self)[1:]:
            t = getattr(self, f.name)
            if f.name != "advantages" and t is not None and t.shape != shape:
                raise ValueError(f"{f.name}: shape {tuple(t.shape)} must equal logp's {tuple(shape)}.")
        if self.advantages.shape not in (shape, shape[:1]):
            raise ValueError(f"advantages: shape {tuple(self.advantages.shape)} must be [B]={tuple(shape[:1])} "
                             "or [B, T].")
