"""What the tests of tests/config share: a small, fully known model and the violations validate() reports."""

from pathlib import Path

import pytest

from mcpo_megatron.config import ConfigError, load_config, validate

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"

# A small, fully known model so that layout rules do not depend on the built-in table.
TINY = ["model.arch.num_layers=6", "model.arch.hidden_size=64", "model.arch.num_attention_heads=8",
        "model.arch.num_key_value_heads=4", "model.arch.ffn_hidden_size=128", "model.arch.vocab_size=100",
        "model.arch.max_position_embeddings=32768"]

# TINY as a mixture of experts.
MOE = ["model.arch.family=qwen3_moe", "model.arch.num_experts=8", "model.arch.num_experts_per_tok=2",
       "model.arch.moe_ffn_hidden_size=32"]


def problems(overrides, world_size=1, **kw):
    """The violation lines validate() reports for defaults + TINY + overrides."""
    cfg = load_config(None, TINY + list(overrides))
    with pytest.raises(ConfigError) as ei:
        validate(cfg, world_size, **kw)
    return ei.value.problems


def ok(overrides, world_size=1, **kw):
    return validate(load_config(None, TINY + list(overrides)), world_size, **kw)


def config_files():
    return sorted(CONFIG_DIR.glob("*.yaml"))
