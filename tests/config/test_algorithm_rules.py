"""The algorithm section: clip ranges, the hinge-KL and its inert case, MCPO's reweighting, the reference
KL, TIS, and the combinations that are rejected."""

from mcpo_megatron.config import hinge_is_inert, load_config, validate

from config_cases import TINY, ok, problems


def test_clip_ratios():
    assert problems(["algorithm.clip_ratio_low=0"]) == [
        "algorithm.clip_ratio_low=0.0: must satisfy 0 < clip_ratio_low < 1; "
        "use e.g. 0.2 (ratio clipped below at 1 - clip_ratio_low)"]
    assert problems(["algorithm.clip_ratio_low=1.0"])[0].startswith("algorithm.clip_ratio_low=1.0: must satisfy")
    assert problems(["algorithm.clip_ratio_high=0"]) == [
        "algorithm.clip_ratio_high=0.0: must be > 0; use e.g. 0.28 (clip-higher)"]
    assert problems(["algorithm.clip_ratio_c=1.0"]) == [
        "algorithm.clip_ratio_c=1.0: dual-clip constant must be > 1 when set; use e.g. 10.0, or null to disable dual clip"]
    ok(["algorithm.clip_ratio_c=null"])


def test_log_ratio_clamp():
    assert problems(["algorithm.log_ratio_clamp=0"]) == [
        "algorithm.log_ratio_clamp=0.0: must be > 0 (the PG log-ratio is clamped to [-log_ratio_clamp, "
        "log_ratio_clamp] before exp); use 20.0"]
    ok(["algorithm.log_ratio_clamp=5"])


def test_hinge_parameters():
    assert problems(["algorithm.mcpo.hinge_kl.delta=0"]) == [
        "algorithm.mcpo.hinge_kl.delta=0.0: hinge-KL dead zone must be > 0; use e.g. 0.01"]
    assert problems(["algorithm.mcpo.hinge_kl.coef=-1"]) == [
        "algorithm.mcpo.hinge_kl.coef=-1.0: hinge-KL coefficient beta must be >= 0; use e.g. 1.0"]
    ok(["algorithm.mcpo.hinge_kl.coef=0"])


def test_mcpo_threshold():
    assert problems(["algorithm.mcpo.threshold=1.0"]) == [
        "algorithm.mcpo.threshold=1.0: must satisfy 0 <= threshold < 1; use 0.5"]
    ok(["algorithm.mcpo.threshold=0"])


def test_reject_reweight_with_drgrpo():
    assert problems(["algorithm.adv_estimator=drgrpo"]) == [
        "algorithm.adv_estimator=drgrpo: MCPO reweighting (algorithm.mcpo.reweight=true) is rejected with drgrpo: "
        "the W(x)=0.5 derivation needs std normalisation (docs/algorithms.md §3); use adv_estimator=grpo or set "
        "algorithm.mcpo.reweight=false"]
    ok(["algorithm.adv_estimator=drgrpo", "algorithm.mcpo.reweight=false"])


def test_gspo_requires_seq_mean_token_mean():
    assert problems(["algorithm.ratio_level=sequence", "algorithm.loss_agg_mode=token-mean"]) == [
        "algorithm.loss_agg_mode=token-mean: sequence-level ratios (GSPO, algorithm.ratio_level=sequence) require "
        "seq-mean-token-mean; set algorithm.loss_agg_mode=seq-mean-token-mean"]
    warnings = ok(["algorithm.ratio_level=sequence", "algorithm.clip_ratio_low=3e-4", "algorithm.clip_ratio_high=4e-4"])
    assert not any("GSPO" in w for w in warnings)
    warnings = ok(["algorithm.ratio_level=sequence"])
    assert any(w.startswith("algorithm.ratio_level=sequence (GSPO) with clip_ratio_low=0.2") for w in warnings)


def test_reject_hinge_with_dynamic_sampling():
    assert problems(["algorithm.filter_groups.enable=true"]) == [
        "algorithm.filter_groups.enable=True: rejected with algorithm.mcpo.hinge_kl.enable=true: dynamic sampling "
        "drops every mastered group, so the hinge-KL could never act; disable one of them"]
    ok(["algorithm.filter_groups.enable=true", "algorithm.mcpo.hinge_kl.enable=false"])


def test_reference_kl_rules():
    assert problems(["algorithm.kl.enable=true", "algorithm.kl.coef=-0.1"]) == [
        "algorithm.kl.coef=-0.1: must be >= 0; use e.g. 0.001"]
    warnings = ok(["algorithm.name=grpo", "algorithm.kl.enable=true", "algorithm.kl.coef=0"])
    assert any(w.startswith("algorithm.kl.enable=true with algorithm.kl.coef=0") for w in warnings)
    assert not any("algorithm.kl" in w for w in ok(["algorithm.name=grpo", "algorithm.kl.enable=true"]))


def test_tis_is_accepted():
    ok(["algorithm.tis.enable=true"])


def test_inert_hinge_warning():
    cfg = load_config(None, TINY + ["data.train_batch_size=64"])
    assert hinge_is_inert(cfg)
    warnings = validate(cfg, 1)
    inert = [w for w in warnings if "inert" in w]
    assert len(inert) == 1
    assert "the hinge-KL is inert" in inert[0]
    assert "MCPO degenerates to reweight-only" in inert[0]
    assert "hkl/inert=1 will be logged" in inert[0]
    assert "64 / 64 x 1 = 1" in inert[0]


def test_hinge_not_inert_cases():
    assert not hinge_is_inert(load_config())                                          # 128 / 64 = 2 steps
    assert not hinge_is_inert(load_config(None, ["data.train_batch_size=64", "algorithm.ppo_epochs=2"]))
    assert not hinge_is_inert(load_config(None, ["data.train_batch_size=64",
                                                 "algorithm.mcpo.hinge_kl.enable=false"]))  # off, not inert
    assert not any("inert" in w for w in validate(load_config(None, TINY), 1))
