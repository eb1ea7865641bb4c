"""The model section: the model's shape (model.arch, config.json, the built-in table) and the rules on
model.path, model.tokenizer and the sequence lengths the model can hold."""

import json

import pytest

from mcpo_megatron.config import ConfigError, load_config, model_shape, validate

from config_cases import TINY, ok, problems


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


def test_max_position_embeddings():
    cfg = load_config(None, ["model.path=builtin:smollm2-135m-instruct"])
    with pytest.raises(ConfigError) as ei:
        validate(cfg, 1)
    assert ei.value.problems == [
        "data.max_prompt_length+data.max_response_length=22528: must be <= max_position_embeddings=8192 "
        "(from builtin table); shorten data.max_prompt_length / data.max_response_length"]


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


HYBRID_SIZES = {"num_hidden_layers": 4, "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
                "intermediate_size": 64, "vocab_size": 256, "head_dim": 8, "max_position_embeddings": 32768}


@pytest.mark.parametrize("hf", [
    {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
     "text_config": {"model_type": "qwen3_5_moe_text"}},
    {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next"},
    {"architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text"},
], ids=["qwen3_5_moe-vl", "qwen3_next", "qwen3_5_moe"])
def test_training_a_hybrid_model_other_than_dense_qwen3_5_is_refused_before_any_process_group(tmp_path, hf):
    text = hf.get("text_config", hf)
    text.update(HYBRID_SIZES)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ConfigError) as ei:
        validate(load_config(None, [f"model.path={tmp_path}", "rollout.engine=torch"]), 1)
    (problem,) = [p for p in ei.value.problems if "Gated DeltaNet" in p]
    assert problem.startswith(f"model.path={tmp_path}: a hybrid")
    assert f"hybrid Gated DeltaNet model ({text['model_type']}) cannot be trained yet" in problem
    assert problem.endswith("train a Qwen3.5 dense, Qwen3, Qwen3-MoE, Qwen2 or Llama model")


@pytest.mark.parametrize("form", ["text-only", "multimodal"])
def test_dense_qwen3_5_trains_with_the_pytorch_engine_only(tmp_path, form):
    hf = dict(HYBRID_SIZES, architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text")
    if form == "multimodal":   # the form Qwen3.5 checkpoints ship in: the policy trains its language model
        hf = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
              "text_config": dict(HYBRID_SIZES, model_type="qwen3_5_text"), "vision_config": {"depth": 1}}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ConfigError) as ei:
        validate(load_config(None, [f"model.path={tmp_path}", "rollout.engine=vllm"]), 1)
    (problem,) = [p for p in ei.value.problems if "Gated DeltaNet" in p]
    assert problem.startswith("rollout.engine=vllm: a hybrid") and problem.endswith("set rollout.engine=torch")
    validate(load_config(None, [f"model.path={tmp_path}", "rollout.engine=torch"]), 1)  # raises on any problem
    with pytest.raises(ConfigError) as ei:
        validate(load_config(None, [f"model.path={tmp_path}", "rollout.engine=torch", "trainer.sequence_packing=true"]),
                 1)
    assert [p for p in ei.value.problems if "Gated DeltaNet" in p] == [
        "trainer.sequence_packing=True: is not supported for hybrid Gated DeltaNet models yet; "
        "set trainer.sequence_packing=false"]
