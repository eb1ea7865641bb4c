"""The ``algorithm`` section: the preset (``algorithm.name``), the advantage estimator and clipped objective, and
its components (reference KL, TIS, dynamic sampling, GCPO, MCPO's reweighting and hinge-KL)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from mcpo_megatron.config import presets
from mcpo_megatron.config.checks import Checks, at_least, choice


@dataclass
class KLConfig:
    """Reference-policy KL loss, GRPO's original recipe: coef x KL(pi || pi_ref) per token, estimated by k1, k2 or
    k3 (verl's kl, mse, low_var_kl) against a frozen copy of the initial policy (models/reference.py; one more
    copy of the weights per GPU, counted by mcpo plan). Off in every preset."""
    enable: bool = False
    coef: float = 0.001
    type: str = choice("k1", "k2", "k3", default="k3")

    def check(self, c: Checks) -> None:
        if self.enable and not self.coef >= 0:
            c.error("algorithm.kl.coef", self.coef, "must be >= 0", "use e.g. 0.001")
        if self.enable and self.coef == 0:
            c.warn("algorithm.kl.enable=true with algorithm.kl.coef=0: the reference policy is built and its KL "
                   "reported (actor/kl_mean), but the loss does not use it")


@dataclass
class TISConfig:
    """Truncated importance sampling correction with the rollout engine's log-probs (docs/algorithms.md §8: the
    behaviour weight min(pi_old / pi_engine, cap) of decoupled PPO)."""
    enable: Optional[bool] = None                 # null: on when trainer.max_staleness > 0, else off
    cap: float = 2.0

    def check(self, c: Checks) -> None:
        if self.enable and not self.cap >= 1:
            c.error("algorithm.tis.cap", self.cap, "truncation cap must be >= 1", "use e.g. 2.0")


def _check_band(c: Checks, prefix: str, low: float, high: float) -> None:
    if not 0 < low <= 1:
        c.error(f"{prefix}.low", low, "must satisfy 0 < low <= 1 (the band must hold ratio 1, an on-policy token)",
                "use e.g. 0.5")
    if not high >= 1:
        c.error(f"{prefix}.high", high, "must be >= 1 (the band must hold ratio 1, an on-policy token)",
                "use e.g. 2.0")


@dataclass
class TokenMaskConfig:
    """Token masking outside a ratio band (IcePop; docs/algorithms.md §8): a token whose behaviour ratio
    pi_old / pi_engine lies outside [low, high] gets no policy-gradient weight. With algorithm.tis on (cap >= high)
    the tokens inside keep the weight pi_old / pi_engine: IcePop's objective."""
    enable: bool = False
    low: float = 0.5
    high: float = 5.0

    def check(self, c: Checks) -> None:
        if self.enable:
            _check_band(c, "algorithm.token_mask", self.low, self.high)


@dataclass
class SequenceMaskConfig:
    """Sequence-level masked importance sampling (docs/algorithms.md §8): a response whose ratio lies outside
    [low, high] gets no policy-gradient weight. ratio: geometric (the geometric mean of its tokens' pi_old /
    pi_engine, independent of its length) or product (the sequence's likelihood ratio)."""
    enable: bool = False
    ratio: str = choice("geometric", "product")
    low: float = 0.5
    high: float = 2.0

    def check(self, c: Checks) -> None:
        if self.enable:
            _check_band(c, "algorithm.sequence_mask", self.low, self.high)


@dataclass
class FilterGroupsConfig:
    """DAPO dynamic sampling: drop all-correct / all-wrong groups and over-sample until the batch is full."""
    enable: bool = False
    max_gen_batches: int = at_least(10, 1)


@dataclass
class GCPOConfig:
    """GCPO: replace the lowest-reward rollout of an all-wrong group with a verified reference answer."""
    enable: bool = False
    references: Optional[str] = None              # path to a JSONL of reference answers

    def check(self, c: Checks) -> None:
        if self.enable and not self.references:
            c.error("algorithm.gcpo.references", self.references,
                    "GCPO (algorithm.gcpo.enable=true) needs a file of verified reference answers",
                    "set algorithm.gcpo.references to a JSONL path")


@dataclass
class HingeKLConfig:
    """MCPO hinge-KL on mastered prompts (docs/algorithms.md §6, paper Eq. 7-11)."""
    enable: bool = True
    coef: float = 1.0                             # beta
    delta: float = 0.01
    agg: str = choice("mastered", "batch")  # mastered (1/|M_B|, Eq. 11) | batch (1/N)
    d_clamp: float = 20.0                         # overflow guard on the hinge's d = log pi - log pi_old only

    def check(self, c: Checks) -> None:
        if not self.delta > 0:
            c.error("algorithm.mcpo.hinge_kl.delta", self.delta, "hinge-KL dead zone must be > 0", "use e.g. 0.01")
        if not self.coef >= 0:
            c.error("algorithm.mcpo.hinge_kl.coef", self.coef, "hinge-KL coefficient beta must be >= 0",
                    "use e.g. 1.0")
        if not self.d_clamp > 0:
            c.error("algorithm.mcpo.hinge_kl.d_clamp", self.d_clamp, "must be > 0", "use 20.0")


@dataclass
class MCPOConfig:
    reweight: bool = True                         # advantage reweighting, docs/algorithms.md §3 (Eq. 12-14)
    threshold: float = 0.5                        # scale applies for threshold < p(x) < 1
    hinge_kl: HingeKLConfig = field(default_factory=HingeKLConfig)

    def check(self, c: Checks) -> None:
        if not 0 <= self.threshold < 1:
            c.error("algorithm.mcpo.threshold", self.threshold, "must satisfy 0 <= threshold < 1", "use 0.5")


def hinge_is_inert(cfg) -> bool:
    """True when the hinge-KL is enabled but can never act: with one optimizer step per global step,
    log pi_theta == log pi_old on every step (docs/algorithms.md §6), so MCPO degenerates to reweight-only."""
    a = cfg.algorithm
    if not a.mcpo.hinge_kl.enable or a.mini_batch_size <= 0:
        return False
    return (cfg.data.train_batch_size // a.mini_batch_size) * a.ppo_epochs == 1


@dataclass
class AlgorithmConfig:
    # A preset (presets.PRESETS) that sets the algorithm's defaults; explicit keys override it.
    name: str = choice(*presets.PRESETS, default=presets.DEFAULT_PRESET)
    adv_estimator: str = choice("grpo", "drgrpo")
    std_mode: str = choice("unbiased", "population")  # unbiased (verl parity) | population (A.3)
    eps: float = 1.0e-6
    ratio_level: str = choice("token", "sequence")  # sequence: GSPO
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.28
    clip_ratio_c: Optional[float] = 10.0          # dual clip for A < 0; null disables
    # Overflow guard: the PG (and TIS) log-ratio is clamped to [-v, v] before exp; no gradient where it acts.
    log_ratio_clamp: float = 20.0
    loss_agg_mode: str = choice("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm",
                           default="seq-mean-token-mean")
    ppo_epochs: int = at_least(1, 1)
    mini_batch_size: int = at_least(64, 1)        # prompts per optimizer step
    entropy_coeff: float = 0.0
    kl: KLConfig = field(default_factory=KLConfig)
    tis: TISConfig = field(default_factory=TISConfig)
    token_mask: TokenMaskConfig = field(default_factory=TokenMaskConfig)
    sequence_mask: SequenceMaskConfig = field(default_factory=SequenceMaskConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    gcpo: GCPOConfig = field(default_factory=GCPOConfig)
    mcpo: MCPOConfig = field(default_factory=MCPOConfig)

    def check(self, c: Checks) -> None:
        d, n = c.derived, c.cfg.rollout.n
        if d is not None and d.dp >= 1 and self.mini_batch_size >= 1 and n >= 1 and (self.mini_batch_size * n) % d.dp:
            c.error("algorithm.mini_batch_size", self.mini_batch_size,
                    f"mini_batch_size x rollout.n = {self.mini_batch_size * n} sequences per optimizer step must be "
                    f"divisible by the data-parallel size {d.dp} (= {c.world_size} / ({d.tp} x {d.pp}))",
                    "change algorithm.mini_batch_size, rollout.n or the parallel layout")
        if not 0 < self.clip_ratio_low < 1:
            c.error("algorithm.clip_ratio_low", self.clip_ratio_low, "must satisfy 0 < clip_ratio_low < 1",
                    "use e.g. 0.2 (ratio clipped below at 1 - clip_ratio_low)")
        if not self.clip_ratio_high > 0:
            c.error("algorithm.clip_ratio_high", self.clip_ratio_high, "must be > 0", "use e.g. 0.28 (clip-higher)")
        if self.clip_ratio_c is not None and not self.clip_ratio_c > 1:
            c.error("algorithm.clip_ratio_c", self.clip_ratio_c, "dual-clip constant must be > 1 when set",
                    "use e.g. 10.0, or null to disable dual clip")
        if not self.eps > 0:
            c.error("algorithm.eps", self.eps, "must be > 0 (added to the group std)", "use 1e-6")
        if not self.log_ratio_clamp > 0:
            c.error("algorithm.log_ratio_clamp", self.log_ratio_clamp, "must be > 0 (the PG log-ratio is clamped "
                    "to [-log_ratio_clamp, log_ratio_clamp] before exp)", "use 20.0")
        if self.entropy_coeff < 0:
            c.error("algorithm.entropy_coeff", self.entropy_coeff, "must be >= 0", "use 0 (no entropy bonus)")

        # Combinations that cannot work (docs/algorithms.md §2), and overrides that contradict the preset.
        if self.mcpo.reweight and self.adv_estimator == "drgrpo":
            c.error("algorithm.adv_estimator", self.adv_estimator,
                    "MCPO reweighting (algorithm.mcpo.reweight=true) is rejected with drgrpo: the W(x)=0.5 "
                    "derivation needs std normalisation (docs/algorithms.md §3)",
                    "use adv_estimator=grpo or set algorithm.mcpo.reweight=false")
        if self.ratio_level == "sequence" and self.loss_agg_mode != "seq-mean-token-mean":
            c.error("algorithm.loss_agg_mode", self.loss_agg_mode,
                    "sequence-level ratios (GSPO, algorithm.ratio_level=sequence) require seq-mean-token-mean",
                    "set algorithm.loss_agg_mode=seq-mean-token-mean")
        if self.mcpo.hinge_kl.enable and self.filter_groups.enable:
            c.error("algorithm.filter_groups.enable", self.filter_groups.enable,
                    "rejected with algorithm.mcpo.hinge_kl.enable=true: dynamic sampling drops every mastered "
                    "group, so the hinge-KL could never act", "disable one of them")
        if self.name in presets.PRESETS:
            for key, value, rule, fix in presets.contradictions(self):
                c.error(key, value, rule, fix)

        if hinge_is_inert(c.cfg):
            c.warn(f"algorithm.mcpo.hinge_kl: the hinge-KL is inert: one optimizer step per global step "
                   f"(data.train_batch_size / algorithm.mini_batch_size x algorithm.ppo_epochs = "
                   f"{c.cfg.data.train_batch_size} / {self.mini_batch_size} x {self.ppo_epochs} = 1) means "
                   f"log pi == log pi_old on every step, so MCPO degenerates to reweight-only; hkl/inert=1 will be "
                   f"logged. Use a smaller algorithm.mini_batch_size (or ppo_epochs > 1) for the hinge to act.")
        if self.ratio_level == "sequence" and self.clip_ratio_low > 0.01:
            c.warn(f"algorithm.ratio_level=sequence (GSPO) with clip_ratio_low={self.clip_ratio_low}: GSPO uses "
                   f"sequence-ratio clip ranges of about 3e-4 / 4e-4 (docs/algorithms.md §5)")
