"""Independent float64 reference of the formulas of docs/algorithms.md, written as plain loops, sharing no code with
the library: it checks both implementations of the loss (the literal definition and the fused one) and the advantages.

Per-token terms are built from 0-d float64 tensors so that autograd gives reference gradients; aggregation follows
the formulas literally (docs/algorithms.md §3-§6), over the whole mini-batch at once.
"""

from __future__ import annotations

import math

import torch


def k3(d):
    return torch.exp(d) - d - 1.0 if isinstance(d, torch.Tensor) else math.exp(d) - d - 1.0


def phi(d, delta):
    """Eq. (10) literally: 0 in the band, k3(d) - k3(+-delta) outside."""
    x = float(d.detach()) if isinstance(d, torch.Tensor) else float(d)
    if abs(x) <= delta:
        return d * 0.0
    c = k3(delta) if x > 0 else k3(-delta)
    return k3(d) - c


def pg_term(r, a, clip_low, clip_high, clip_c):
    """max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)), then min(., -A c) for A < 0 (dual clip)."""
    clipped = torch.clamp(r, 1.0 - clip_low, 1.0 + clip_high)
    term = torch.maximum(-a * r, -a * clipped)
    if clip_c is not None and a < 0:
        term = torch.clamp(term, max=-a * clip_c)
    return term


def reference_loss(logp, old_logp, lengths, adv, mastered, *, mode, max_len=None, clip_low=0.2, clip_high=0.28,
                   clip_c=10.0, hinge=True, beta=1.0, delta=0.01, hinge_agg="mastered", ratio_level="token"):
    """Full mini-batch loss L = L_PG + beta L_HKL, from lists of per-sequence 1-D tensors.

    logp: list of 1-D tensors (requires grad) of length lengths[i]; adv: list of floats; mastered: list of bools.
    """
    seqs = [i for i, n in enumerate(lengths) if n > 0]
    big_n = len(seqs)
    total_tokens = sum(lengths)
    pg = torch.zeros((), dtype=torch.float64)
    for i in seqs:
        n = lengths[i]
        if ratio_level == "sequence":
            # GSPO: s_i = exp(mean_t (logp - old)), one clipped term per sequence, times |y_i| token copies
            s = torch.exp(sum(logp[i][t] - old_logp[i][t] for t in range(n)) / n)
            terms = [pg_term(s, adv[i], clip_low, clip_high, clip_c)] * n
        else:
            terms = [pg_term(torch.exp(logp[i][t] - old_logp[i][t]), adv[i], clip_low, clip_high, clip_c)
                     for t in range(n)]
        seq_sum = sum(terms)
        if mode == "token-mean":
            pg = pg + seq_sum / total_tokens
        elif mode == "seq-mean-token-mean":
            pg = pg + seq_sum / n / big_n
        elif mode == "seq-mean-token-sum":
            pg = pg + seq_sum / big_n
        elif mode == "seq-mean-token-sum-norm":
            pg = pg + seq_sum / (max_len * big_n)
        else:
            raise ValueError(mode)
    loss = pg
    if hinge:
        m_b = [i for i in seqs if mastered[i]]
        denom = len(m_b) if hinge_agg == "mastered" else big_n
        hkl = torch.zeros((), dtype=torch.float64)
        for i in m_b:
            n = lengths[i]
            hkl = hkl + sum(phi(logp[i][t] - old_logp[i][t], delta) for t in range(n)) / n / denom
        loss = loss + beta * hkl
    return loss


def reference_advantages(rewards, correct, g, *, estimator, std_mode="unbiased", eps=1e-6, threshold=0.5):
    """docs/algorithms.md §3 with plain Python floats, group by group."""
    out = []
    for start in range(0, len(rewards), g):
        r = [float(x) for x in rewards[start:start + g]]
        c = [float(x) for x in correct[start:start + g]]
        if g == 1 or max(r) == min(r):
            out += [0.0] * g
            continue
        mean = sum(r) / g
        ddof = 1 if std_mode == "unbiased" else 0
        std = math.sqrt(sum((x - mean) ** 2 for x in r) / (g - ddof))
        p = sum(c) / g
        if estimator == "drgrpo":
            a = [x - mean for x in r]
        else:
            a = [(x - mean) / (std + eps) for x in r]
            if estimator == "mcpo" and threshold < p < 1:
                a = [x / (2 * math.sqrt(p * (1 - p))) for x in a]
        out += a
    return out
