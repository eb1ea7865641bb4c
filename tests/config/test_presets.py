"""Algorithm presets: algorithm.name sets an algorithm's defaults, explicit keys override them, and an
override that makes another algorithm is rejected naming both keys."""

import pytest

from mcpo_megatron import config as C
from mcpo_megatron.config import ConfigError, load_config, validate

from config_cases import TINY, config_files, ok, problems


# docs/algorithms.md §2-§10, written out here independently of mcpo_megatron.config.presets:
# (adv_estimator, loss_agg_mode, clip low, clip high, ratio level, reweight, hinge, dynamic sampling, gcpo)
SPEC_PRESETS = {
    "mcpo": ("grpo", "seq-mean-token-mean", 0.2, 0.28, "token", True, True, False, False),
    "dapo": ("grpo", "seq-mean-token-mean", 0.2, 0.28, "token", False, False, True, False),
    "grpo": ("grpo", "seq-mean-token-mean", 0.2, 0.2, "token", False, False, False, False),
    "drgrpo": ("drgrpo", "seq-mean-token-sum-norm", 0.2, 0.2, "token", False, False, False, False),
    "gspo": ("grpo", "seq-mean-token-mean", 3e-4, 4e-4, "sequence", False, False, False, False),
    "gcpo": ("grpo", "seq-mean-token-mean", 3e-4, 4e-4, "sequence", False, False, False, True),
}


def _algorithm_tuple(cfg):
    a = cfg.algorithm
    return (a.adv_estimator, a.loss_agg_mode, a.clip_ratio_low, a.clip_ratio_high, a.ratio_level,
            a.mcpo.reweight, a.mcpo.hinge_kl.enable, a.filter_groups.enable, a.gcpo.enable)


@pytest.mark.parametrize("name", sorted(SPEC_PRESETS))
def test_algorithm_name_is_a_preset(name):
    """`algorithm.name=dapo` used to be a free label: the run stayed MCPO (hinge-KL and reweighting on)."""
    extra = ["algorithm.gcpo.references=refs.jsonl"] if name == "gcpo" else []
    cfg = load_config(None, TINY + [f"algorithm.name={name}"] + extra)
    assert _algorithm_tuple(cfg) == SPEC_PRESETS[name]
    warnings = validate(cfg, 1)
    assert not any("GSPO uses sequence-ratio clip ranges" in w for w in warnings)


def test_preset_from_yaml_and_explicit_keys_override_it(tmp_path):
    f = tmp_path / "dapo.yaml"
    f.write_text("algorithm:\n  name: dapo\n  clip_ratio_high: 0.3\n")
    cfg = load_config(str(f))
    assert _algorithm_tuple(cfg) == ("grpo", "seq-mean-token-mean", 0.2, 0.3, "token", False, False, True, False)
    cfg = load_config(str(f), ["algorithm.filter_groups.enable=false", "algorithm.name=grpo"])
    assert _algorithm_tuple(cfg) == ("grpo", "seq-mean-token-mean", 0.2, 0.3, "token", False, False, False, False)
    # an override naming the preset comes last, yet keys set in the YAML still override it
    assert load_config(str(f), ["algorithm.name=gspo"]).algorithm.clip_ratio_high == 0.3


def test_unknown_preset_is_a_load_error():
    with pytest.raises(ConfigError) as ei:
        load_config(None, ["algorithm.name=dapo_ds"])
    assert ei.value.problems == [
        "algorithm.name='dapo_ds': not an algorithm preset; use one of mcpo | dapo | grpo | drgrpo | gspo | gcpo "
        "(explicit algorithm.* keys then override its defaults)"]


def test_preset_contradictions_name_both_keys():
    assert problems(["algorithm.name=dapo", "algorithm.mcpo.hinge_kl.enable=true",
                     "algorithm.filter_groups.enable=false"]) == [
        "algorithm.mcpo.hinge_kl.enable=True: contradicts algorithm.name=dapo (the dapo preset fixes "
        "mcpo.hinge_kl.enable=False: advantage reweighting and the hinge-KL are MCPO's components); use "
        "algorithm.name=mcpo, or drop the algorithm.mcpo.hinge_kl.enable override"]
    assert problems(["algorithm.name=grpo", "algorithm.mcpo.reweight=true"]) == [
        "algorithm.mcpo.reweight=True: contradicts algorithm.name=grpo (the grpo preset fixes mcpo.reweight=False: "
        "advantage reweighting and the hinge-KL are MCPO's components); use algorithm.name=mcpo, or drop the "
        "algorithm.mcpo.reweight override"]
    assert problems(["algorithm.name=gspo", "algorithm.ratio_level=token"]) == [
        "algorithm.ratio_level=token: contradicts algorithm.name=gspo (the gspo preset fixes ratio_level=sequence: "
        "GSPO and GCPO use sequence-level ratios, the others token-level ones); use algorithm.name=grpo, or drop "
        "the algorithm.ratio_level override"]
    assert problems(["algorithm.name=drgrpo", "algorithm.adv_estimator=grpo"]) == [
        "algorithm.adv_estimator=grpo: contradicts algorithm.name=drgrpo (the drgrpo preset fixes "
        "adv_estimator=drgrpo: Dr.GRPO is the estimator without std normalisation); use algorithm.name=grpo, or "
        "drop the algorithm.adv_estimator override"]
    assert problems(["algorithm.name=gcpo", "algorithm.gcpo.enable=false"]) == [
        "algorithm.gcpo.enable=False: contradicts algorithm.name=gcpo (the gcpo preset fixes gcpo.enable=True: "
        "reference-answer injection is GCPO's); use algorithm.name=gspo, or drop the algorithm.gcpo.enable "
        "override"]
    assert problems(["algorithm.mcpo.reweight=false", "algorithm.mcpo.hinge_kl.enable=false"]) == [
        "algorithm.mcpo.hinge_kl.enable=False: contradicts algorithm.name=mcpo together with "
        "algorithm.mcpo.reweight=False (with both of MCPO's components off the run is DAPO without dynamic "
        "sampling); use algorithm.name=dapo algorithm.filter_groups.enable=false, or keep one component on"]


def test_preset_overrides_that_stay_the_same_algorithm_are_accepted():
    ok(["algorithm.name=dapo", "algorithm.filter_groups.enable=false"])         # DAPO without DS (docs/algorithms.md §2)
    ok(["algorithm.name=mcpo", "algorithm.mcpo.hinge_kl.enable=false"])         # the paper's ablations
    ok(["algorithm.name=mcpo", "algorithm.mcpo.reweight=false"])
    ok(["algorithm.name=mcpo", "algorithm.ratio_level=sequence", "algorithm.clip_ratio_low=3e-4",
        "algorithm.clip_ratio_high=4e-4"])                                        # MCPO on GSPO (docs/algorithms.md §5)
    ok(["algorithm.name=grpo", "algorithm.clip_ratio_high=0.28"])


def test_preset_description_and_report_label():
    from mcpo_megatron.config import presets
    from mcpo_megatron.report.runs import flatten

    cfg = load_config(None, ["algorithm.name=dapo", "algorithm.filter_groups.enable=false"])
    assert presets.describe(cfg.algorithm) == (
        "algorithm preset 'dapo' (algorithm.name) sets adv_estimator=grpo, loss_agg_mode=seq-mean-token-mean, "
        "clip_ratio_low=0.2, clip_ratio_high=0.28, ratio_level=token, mcpo.reweight=False, "
        "mcpo.hinge_kl.enable=False, filter_groups.enable=True, gcpo.enable=False; overridden by explicit keys: "
        "algorithm.filter_groups.enable=False")
    assert presets.label(flatten(C.to_dict(cfg))) == "dapo (filter_groups.enable=False)"
    assert presets.label(flatten(C.to_dict(load_config(None, ["algorithm.name=gspo"])))) == "gspo"
    assert presets.label({"algorithm.name": "dapo_ds"}) is None


def test_recipes_use_presets():
    for path in config_files():
        cfg = load_config(str(path))
        assert cfg.algorithm.name in SPEC_PRESETS, path.name
        assert not [c for c in C.presets.contradictions(cfg.algorithm)], path.name
