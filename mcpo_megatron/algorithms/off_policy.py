"""Off-policy corrections on the behaviour ratio rho = pi_old / mu of each sampled token, beside truncated
importance sampling (docs/algorithms.md §8): masks that take a token, or a whole response, out of the
policy-gradient term when rho leaves a band, and the ratio's statistics.

pi_old is the trainer's recomputation at the start of the global step (``old_logp``) and mu the engine's
processed log-prob of the token (``rollout_logp``), which with partial rollouts and staleness comes from an older
policy version (§13). Per response i with tokens t:

    token mask (IcePop):            m_it = 1[low <= rho_it <= high]                                       (§8.2)
    sequence mask (masked IS):      m_i  = 1[low <= rho_i <= high],
                                    rho_i = exp(mean_t log rho_it) (geometric) or exp(sum_t log rho_it) (product)  (§8.3)

A masked token keeps its place in every loss denominator of §4 (the mask is an importance weight of 0, the
estimator the papers write); only its PG term is 0. Tensors in, tensors out, computed in float64.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SEQUENCE_RATIOS = ("geometric", "product")


@dataclass(frozen=True)
class MaskSettings:
    """Which masks are on and their bands (``from_config`` reads ``algorithm.token_mask`` / ``sequence_mask``)."""

    token_band: tuple[float, float] | None = None       # (low, high) of rho_it, or None: no token mask
    sequence_band: tuple[float, float] | None = None    # (low, high) of rho_i, or None: no sequence mask
    sequence_ratio: str = "geometric"

    def __post_init__(self):
        if self.sequence_ratio not in SEQUENCE_RATIOS:
            raise ValueError(f"sequence_ratio={self.sequence_ratio!r} must be one of {SEQUENCE_RATIOS}")
        for name, band in (("token_band", self.token_band), ("sequence_band", self.sequence_band)):
            if band is not None and not 0 < band[0] <= 1 <= band[1]:
                raise ValueError(f"{name}={band!r}: need 0 < low <= 1 <= high")

    @property
    def enabled(self) -> bool:
        return self.token_band is not None or self.sequence_band is not None

    @classmethod
    def from_config(cls, a) -> "MaskSettings":
        tm, sm = a.token_mask, a.sequence_mask
        return cls(token_band=(float(tm.low), float(tm.high)) if tm.enable else None,
                   sequence_band=(float(sm.low), float(sm.high)) if sm.enable else None,
                   sequence_ratio=str(sm.ratio))


def log_ratio(old_logp: torch.Tensor, rollout_logp: torch.Tensor) -> torch.Tensor:
    """log rho = log pi_old - log mu of each token of one response ([T] each), in float64."""
    if old_logp.shape != rollout_logp.shape:
        raise ValueError(f"old_logp {tuple(old_logp.shape)} and rollout_logp {tuple(rollout_logp.shape)} differ")
    return old_logp.double() - rollout_logp.double()


def sequence_log_ratio(log_rho: torch.Tensor, ratio: str = "geometric") -> float:
    """log rho_i of one response from its tokens' log rho: their mean (geometric) or sum (product); 0 when empty."""
    if ratio not in SEQUENCE_RATIOS:
        raise ValueError(f"ratio={ratio!r} must be one of {SEQUENCE_RATIOS}")
    if log_rho.numel() == 0:
        return 0.0
    return float(log_rho.sum() / log_rho.numel()) if ratio == "geometric" else float(log_rho.sum())


def in_band(log_value: torch.Tensor | float, band: tuple[float, float]) -> torch.Tensor | bool:
    """low <= exp(log_value) <= high, compared in log space (no overflow for a product over 20,000 tokens)."""
    lo, hi = math.log(band[0]), math.log(band[1])
    if isinstance(log_value, torch.Tensor):
        return (log_value >= lo) & (log_value <= hi)
    return lo <= log_value <= hi


def behaviour_mask(old_logp: torch.Tensor, rollout_logp: torch.Tensor, settings: MaskSettings) -> torch.Tensor:
    """[T] float 0/1: the product of the token mask and the sequence mask of one response (1 where neither is on)."""
    lr = log_ratio(old_logp, rollout_logp)
    keep = torch.ones_like(lr, dtype=torch.bool)
    if settings.token_band is not None:
        keep &= in_band(lr, settings.token_band)
    if settings.sequence_band is not None and not in_band(sequence_log_ratio(lr, settings.sequence_ratio),
                                                          settings.sequence_band):
        keep[:] = False
    return keep.to(old_logp.dtype if old_logp.is_floating_point() else torch.float32)


@dataclass
class RatioStats:
    """Sums and extremes of the behaviour ratio over a set of responses (they compose: :meth:`merge`)."""

    tokens: int = 0
    ratio_sum: float = 0.0
    ratio_min: float = math.inf
    ratio_max: float = -math.inf
    sequences: int = 0
    seq_ratio_sum: float = 0.0
    seq_ratio_min: float = math.inf
    seq_ratio_max: float = -math.inf
    masked_tokens: int = 0
    masked_sequences: int = 0             # responses every token of which is masked

    def add(self, old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor | None,
            ratio: str = "geometric") -> None:
        lr = log_ratio(old_logp, rollout_logp)
        if lr.numel() == 0:
            return
        rho = lr.exp()
        seq = math.exp(sequence_log_ratio(lr, ratio)) if ratio == "geometric" else math.exp(
            min(sequence_log_ratio(lr, ratio), 700.0))
        self.tokens += lr.numel()
        self.ratio_sum += float(rho.sum())
        self.ratio_min, self.ratio_max = min(self.ratio_min, float(rho.min())), max(self.ratio_max, float(rho.max()))
        self.sequences += 1
        self.seq_ratio_sum += seq
        self.seq_ratio_min, self.seq_ratio_max = min(self.seq_ratio_min, seq), max(self.seq_ratio_max, seq)
        if mask is not None:
            masked = int((mask == 0).sum())
            self.masked_tokens += masked
            self.masked_sequences += int(masked == lr.numel())

    def metrics(self) -> dict[str, float]:
        """``offpolicy/*``: the ratio's mean, min and max per token and per response, and the masked fractions."""
        tokens, seqs = max(self.tokens, 1), max(self.sequences, 1)
        return {
            "offpolicy/ratio_mean": self.ratio_sum / tokens if self.tokens else 1.0,
            "offpolicy/ratio_min": self.ratio_min if self.tokens else 1.0,
            "offpolicy/ratio_max": self.ratio_max if self.tokens else 1.0,
            "offpolicy/seq_ratio_mean": self.seq_ratio_sum / seqs if self.sequences else 1.0,
            "offpolicy/seq_ratio_min": self.seq_ratio_min if self.sequences else 1.0,
            "offpolicy/seq_ratio_max": self.seq_ratio_max if self.sequences else 1.0,
            "offpolicy/masked_token_frac": self.masked_tokens / tokens,
            "offpolicy/masked_seq_frac": self.masked_sequences / seqs,
        }
