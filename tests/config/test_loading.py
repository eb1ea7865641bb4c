"""Loading a config: schema defaults, overrides, YAML files and their _base_ chain, unknown keys and wrong
types reported with where they came from, and a config package that stays free of torch."""

import pytest
from omegaconf import OmegaConf

from mcpo_megatron import config as C
from mcpo_megatron.config import ConfigError, load_config, validate

from config_cases import MOE, problems


def test_defaults_follow_spec_section_4():
    cfg = load_config()
    a = cfg.algorithm
    assert (a.adv_estimator, a.std_mode, a.eps, a.ratio_level) == ("grpo", "unbiased", 1e-6, "token")
    assert (a.clip_ratio_low, a.clip_ratio_high, a.clip_ratio_c, a.log_ratio_clamp) == (0.2, 0.28, 10.0, 20.0)
    assert (a.loss_agg_mode, a.ppo_epochs, a.mini_batch_size, a.entropy_coeff) == ("seq-mean-token-mean", 1, 64, 0.0)
    assert (a.kl.enable, a.filter_groups.enable, a.gcpo.enable, a.tis.enable) == (False, False, False, False)
    assert (a.mcpo.reweight, a.mcpo.threshold) == (True, 0.5)
    hk = a.mcpo.hinge_kl
    assert (hk.enable, hk.coef, hk.delta, hk.agg, hk.d_clamp) == (True, 1.0, 0.01, "mastered", 20.0)
    assert (cfg.optimizer.lr, cfg.optimizer.lr_warmup_steps) == (1e-6, 0)
    assert (cfg.data.train_batch_size, cfg.data.max_prompt_length, cfg.data.max_response_length) == (128, 2048, 20480)
    assert (cfg.rollout.n, cfg.rollout.temperature, cfg.rollout.engine) == (16, 1.0, "torch")
    ob = cfg.reward.overlong_buffer
    assert (ob.enable, ob.len, ob.penalty_factor) == (True, 4096, 1.0)


def test_defaults_validate_on_one_rank():
    warnings = validate(load_config(), 1)
    assert all("inert" not in w for w in warnings)


def test_config_is_typed_and_strict():
    cfg = load_config()
    with pytest.raises(Exception):
        cfg.rollout.nn  # noqa: B018 - a typo in code reading the config must fail, not return None
    with pytest.raises(Exception):
        cfg.rollout.n = "abc"


def test_nested_and_list_overrides():
    cfg = load_config(None, ["algorithm.mcpo.hinge_kl.delta=0.02", "eval.benchmarks=[aime24,amc23]",
                             "algorithm.clip_ratio_c=null", "rollout.n=8", "model.path=builtin:smollm2-135m-instruct"])
    assert cfg.algorithm.mcpo.hinge_kl.delta == 0.02
    assert list(cfg.eval.benchmarks) == ["aime24", "amc23"]
    assert cfg.algorithm.clip_ratio_c is None
    assert cfg.rollout.n == 8
    assert cfg.model.path == "builtin:smollm2-135m-instruct"
    assert cfg.algorithm.mcpo.hinge_kl.coef == 1.0  # siblings keep their defaults


def test_interpolation_resolved_at_load():
    cfg = load_config(None, ["eval.max_new_tokens=${data.max_response_length}", "data.max_response_length=100"])
    assert cfg.eval.max_new_tokens == 100
    with pytest.raises(ConfigError) as ei:
        load_config(None, ["eval.max_new_tokens=${data.nope}"])
    assert ei.value.problems == ["cannot resolve interpolation: Interpolation key 'data.nope' not found; "
                                 "fix the ${...} reference"]


def test_override_creates_arch_block():
    cfg = load_config(None, ["model.arch.num_layers=4"])
    assert cfg.model.arch.num_layers == 4
    assert cfg.model.arch.hidden_size is None
    assert load_config().model.arch is None


def test_unknown_key_names_key_and_suggests():
    with pytest.raises(ConfigError) as ei:
        load_config(None, ["model.pth=x"])
    assert ei.value.problems == ["model.pth: unknown key (from overrides); did you mean 'model.path'?"]


def test_unknown_key_in_wrong_section_suggests_the_right_one():
    with pytest.raises(ConfigError) as ei:
        load_config(None, ["rollout.mini_batch_size=8"])
    assert ei.value.problems == [
        "rollout.mini_batch_size: unknown key (from overrides); did you mean 'algorithm.mini_batch_size' or "
        "'rollout.generation_batch_size'?"]


def test_unknown_keys_in_yaml_all_reported_with_file(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("algorithm:\n  mcpo:\n    hinge_kl:\n      delt: 0.1\nrollout:\n  temprature: 0.5\n")
    with pytest.raises(ConfigError) as ei:
        load_config(str(f))
    assert ei.value.problems == [
        f"algorithm.mcpo.hinge_kl.delt: unknown key (from {f}); did you mean 'algorithm.mcpo.hinge_kl.delta'?",
        f"rollout.temprature: unknown key (from {f}); did you mean 'rollout.temperature'?",
    ]
    assert str(ei.value).startswith("cannot load config (2 problems):")


def test_type_error_names_key():
    with pytest.raises(ConfigError) as ei:
        load_config(None, ["rollout.n=abc", "optimizer.lr=fast"])
    assert len(ei.value.problems) == 2
    assert ei.value.problems[0].startswith("rollout.n='abc': Value 'abc' of type 'str' could not be converted to Integer")
    assert ei.value.problems[1].startswith("optimizer.lr='fast': Value 'fast' of type 'str' could not be converted to Float")


def test_section_given_a_scalar_is_an_error(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("model: 3\n")
    with pytest.raises(ConfigError) as ei:
        load_config(str(f))
    assert ei.value.problems == [
        f"model=3: expected a section of keys (from {f}); see `mcpo config` for its structure"]


def test_list_given_a_scalar_is_an_error():
    with pytest.raises(ConfigError) as ei:
        load_config(None, ["eval.benchmarks=aime24"])
    assert ei.value.problems == [
        "eval.benchmarks='aime24': expected a list (from overrides); write e.g. eval.benchmarks=[a,b] or a YAML list"]


def test_empty_section_is_allowed(tmp_path):
    f = tmp_path / "empty.yaml"
    f.write_text("rollout:\n#  n: 4\nmodel:\n  path: some/model\n")
    cfg = load_config(str(f))
    assert (cfg.rollout.n, cfg.model.path) == (16, "some/model")


def test_override_without_equals_is_an_error():
    with pytest.raises(ConfigError) as ei:
        load_config(None, ["rollout.n"])
    assert ei.value.problems == ["override 'rollout.n': not of the form key=value; write e.g. rollout.n=8"]


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(str(tmp_path / "nope.yaml"))
    f = tmp_path / "list.yaml"
    f.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="the top level must be a mapping"):
        load_config(str(f))
    f = tmp_path / "broken.yaml"
    f.write_text("model: {path: [\n")
    with pytest.raises(ConfigError, match="cannot parse YAML"):
        load_config(str(f))


def test_base_inheritance(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "root.yaml").write_text("rollout: {n: 4, temperature: 0.9}\ndata: {train_batch_size: 32}\n")
    (tmp_path / "sub" / "mid.yaml").write_text("_base_: ../root.yaml\nrollout: {n: 8}\n")
    (tmp_path / "sub" / "leaf.yaml").write_text("_base_: mid.yaml\ndata: {train_batch_size: 64}\n")
    cfg = load_config(str(tmp_path / "sub" / "leaf.yaml"), ["rollout.temperature=0.5"])
    assert cfg.rollout.n == 8                     # mid overrides root
    assert cfg.data.train_batch_size == 64        # leaf overrides root
    assert cfg.rollout.temperature == 0.5         # command line overrides all files
    assert cfg.rollout.top_p == 1.0               # untouched default
    cfg = load_config(str(tmp_path / "sub" / "leaf.yaml"))
    assert cfg.rollout.temperature == 0.9         # from root


def test_base_list_and_cycle(tmp_path):
    (tmp_path / "a.yaml").write_text("rollout: {n: 4}\n")
    (tmp_path / "b.yaml").write_text("rollout: {n: 6, top_k: 5}\n")
    (tmp_path / "c.yaml").write_text("_base_: [a.yaml, b.yaml]\n")
    cfg = load_config(str(tmp_path / "c.yaml"))
    assert (cfg.rollout.n, cfg.rollout.top_k) == (6, 5)  # later bases win
    (tmp_path / "x.yaml").write_text("_base_: y.yaml\n")
    (tmp_path / "y.yaml").write_text("_base_: x.yaml\n")
    with pytest.raises(ConfigError, match="_base_ cycle"):
        load_config(str(tmp_path / "x.yaml"))


def test_yaml_round_trip(tmp_path):
    cfg = load_config(None, ["rollout.n=8", "eval.benchmarks=[aime24]", "model.arch.num_layers=3"])
    f = tmp_path / "dump.yaml"
    f.write_text(C.to_yaml(cfg))
    assert C.to_dict(load_config(str(f))) == C.to_dict(cfg)
    assert C.to_dict(cfg)["rollout"]["n"] == 8


def test_declared_world_size(tmp_path):
    (tmp_path / "base.yaml").write_text("# world_size: 16\nrollout: {n: 4}\n")
    (tmp_path / "child.yaml").write_text("_base_: base.yaml\n")
    (tmp_path / "own.yaml").write_text("#   world_size:  8\n_base_: base.yaml\n")
    assert C.declared_world_size(str(tmp_path / "child.yaml")) == 16
    assert C.declared_world_size(str(tmp_path / "own.yaml")) == 8
    (tmp_path / "none.yaml").write_text("rollout: {n: 4}\n")
    assert C.declared_world_size(str(tmp_path / "none.yaml")) is None


def test_choice_words_yaml_reads_as_booleans(tmp_path):
    # YAML 1.1 reads `off` as false: the choice field gets its word back, from an override and from a file
    assert load_config(None, ["model.moe_routing_replay=off"]).model.moe_routing_replay == "off"
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  moe_routing_replay: off\n")
    assert load_config(str(path), []).model.moe_routing_replay == "off"
    # a boolean word that is not among the choices is still refused, naming the key
    found = problems(MOE + ["model.moe_routing_replay=on"])
    assert len(found) == 1 and found[0].startswith("model.moe_routing_replay=True: must be one of off | r2 | r3")


def test_config_module_does_not_import_torch():
    import subprocess
    import sys
    code = ("import sys; from mcpo_megatron.config import load_config, validate; "
            "validate(load_config(), 1); print('torch' in sys.modules, 'megatron' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "False False"
    assert OmegaConf.is_config(load_config())
