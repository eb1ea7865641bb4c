"""models/multimodal.py: the language model of a ...ForConditionalGeneration checkpoint, read as its text-only
form. The end-to-end run on such a checkpoint (train, export in its form, transformers loads it):
tests/trainer/test_hybrid_e2e.py."""

from __future__ import annotations

import json

import pytest

from mcpo_megatron.models import multimodal as M
from mcpo_megatron.models.registry import UnsupportedModelError, megatron_shape
from mcpo_megatron.models.tiny import tiny_hf_config


def _wrapper(tie: bool):
    from transformers import Qwen3_5Config

    text = tiny_hf_config("qwen3_5", tie_word_embeddings=not tie)   # the wrapper's value must win
    cfg = Qwen3_5Config(text_config=text.to_dict(), vision_config={"depth": 1}, tie_word_embeddings=tie)
    cfg.architectures = ["Qwen3_5ForConditionalGeneration"]
    return cfg


@pytest.mark.parametrize("tie", [False, True])
def test_the_language_model_config_is_the_text_only_form(tie):
    cfg = _wrapper(tie)
    assert M.is_multimodal(cfg) and M.is_multimodal(cfg.to_dict())
    lm = M.language_model_config(cfg)
    assert type(lm).__name__ == "Qwen3_5TextConfig" and lm.architectures == ["Qwen3_5ForCausalLM"]
    assert lm.tie_word_embeddings is tie and lm.layer_types == cfg.text_config.layer_types
    assert cfg.text_config.tie_word_embeddings is not tie          # the wrapper's own config is left as it was
    shape = megatron_shape(lm, tp=2)
    assert shape.is_hybrid and shape.tie_word_embeddings is tie
    as_dict = M.language_model_config(cfg.to_dict())
    assert as_dict["architectures"] == ["Qwen3_5ForCausalLM"] and as_dict["tie_word_embeddings"] is tie


def test_a_text_only_config_is_itself():
    text = tiny_hf_config("qwen3_5")
    assert not M.is_multimodal(text) and M.language_model_config(text) is text


def test_a_wrapper_around_an_unsupported_language_model_is_refused_naming_it():
    cfg = {"architectures": ["Qwen3VLForConditionalGeneration"], "text_config": {"model_type": "qwen3_vl_text"}}
    with pytest.raises(UnsupportedModelError, match=r"text_config.model_type='qwen3_vl_text'"):
        M.language_model_config(cfg)


def test_checkpoint_names_and_untrained_tensors(tmp_path):
    assert (M.checkpoint_name("model.layers.0.linear_attn.A_log", True)
            == "model.language_model.layers.0.linear_attn.A_log")
    assert M.checkpoint_name("model.embed_tokens.weight", True) == "model.language_model.embed_tokens.weight"
    assert M.checkpoint_name("lm_head.weight", True) == "lm_head.weight"
    assert M.checkpoint_name("model.norm.weight", False) == "model.norm.weight"
    names = ["mtp.fc.weight", "lm_head.weight", "model.language_model.norm.weight", "model.visual.pos_embed.weight"]
    assert M.untrained_names(names) == ["model.visual.pos_embed.weight", "mtp.fc.weight"]
    (tmp_path / "config.json").write_text(json.dumps(_wrapper(False).to_dict()))
    assert M.is_multimodal_dir(tmp_path) and not M.is_multimodal_dir(tmp_path / "absent")
