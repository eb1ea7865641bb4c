"""Typed run configuration: dataclass schema, algorithm presets, YAML loading with ``key=value`` overrides,
validation.

The schema (:mod:`.schema`) is the single source of truth for every key a run accepts. A config is built as

    defaults (the dataclasses)  <-  preset of algorithm.name  <-  YAML file (and its ``_base_`` chain)
                                <-  ``key=value`` overrides

and ``validate(cfg, world_size)`` checks it before any process group exists, reporting every violation at
once; each section's dataclass owns its rules. Modules: ``schema`` (the root, assembling ``sections/``: one module
per group of sections with their rules), ``checks`` (how a section reports a violation), ``presets``
(mcpo | dapo | grpo | drgrpo | gspo | gcpo), ``loading`` (YAML, overrides, unknown-key suggestions),
``shapes`` (the model shape without the weights), ``validation`` (derived sizes, ``validate``), ``arguments``
(the ``CONFIG [key=value ...]`` arguments of every command).

This package must stay light: it imports OmegaConf and the standard library only (``mcpo --help`` and the
launchers import it on machines without torch). torch is imported lazily by ``validate(check_devices=True)``.
"""

from mcpo_megatron.config.arguments import add_config_arguments, config_from_args, split_config_args
from mcpo_megatron.config.errors import ConfigError
from mcpo_megatron.config.loading import (as_dictconfig, declared_world_size, load_config, parse_overrides, to_dict,
                                          to_yaml)
from mcpo_megatron.config.schema import (AlgorithmConfig, ArchConfig, Config, DataConfig, EvalConfig,
                                             ModelConfig, OptimizerConfig, ParallelismConfig, RewardConfig,
                                             RolloutConfig, engine_memory_settings, hinge_is_inert,
                                             offload_enabled, spare_groups)
from mcpo_megatron.config.shapes import KNOWN_SHAPES, ModelShape, model_shape
from mcpo_megatron.config.validation import Derived, derived, role_world_sizes, validate

__all__ = [
    "Config", "ConfigError", "ModelShape", "Derived", "KNOWN_SHAPES",
    "AlgorithmConfig", "ArchConfig", "DataConfig", "EvalConfig", "ModelConfig", "OptimizerConfig",
    "ParallelismConfig", "RewardConfig", "RolloutConfig",
    "load_config", "parse_overrides", "validate", "derived", "role_world_sizes", "as_dictconfig", "model_shape",
    "hinge_is_inert", "engine_memory_settings", "offload_enabled", "spare_groups",
    "to_yaml", "to_dict", "declared_world_size", "add_config_arguments", "config_from_args", "split_config_args",
]
