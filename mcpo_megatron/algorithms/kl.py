"""KL estimators on sampled tokens.

Schulman (2020), "Approximating KL Divergence": for samples y ~ q and r = p(y) / q(y),

    k1 = -log r,    k2 = (log r)^2 / 2,    k3 = (r - 1) - log r,

with E_q[k1] = E_q[k3] = KL(q || p) (k3 is unbiased and never negative; k2 is biased but low-variance).
"""

from __future__ import annotations

import torch


def k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """Per-token k3 = e^x - 1 - x with x = log p(y) - log q(y) at tokens y sampled from q: its mean
    estimates KL(q || p) (Schulman 2020, k3).

    For the train/inference mismatch, q is the rollout engine (the tokens were sampled there) and p the
    trainer: x = log p_trainer - log p_engine, and the mean is KL(engine || trainer). Computed as
    ``expm1(x) - x``, which keeps full relative precision for |x| << 1 (where e^x - 1 - x cancels).
    """
    return torch.expm1(log_ratio) - log_ratio
