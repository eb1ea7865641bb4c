"""The loss's metrics: the sums each micro-batch returns (they compose by addition over micro-batches and ranks)
and the means and fractions a step reports (docs/algorithms.md §5-§8 say what each term is)."""

from __future__ import annotations

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
