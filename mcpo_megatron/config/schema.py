"""The run configuration's schema: one dataclass per section, each with the rules of its fields.

Field declarations carry the simple rules (:func:`~.checks.choice`: allowed values; :func:`~.checks.at_least`:
lower bounds); a section's ``check(c)`` holds the rest, including rules that read other sections (``c.cfg``),
the model shape (``c.shape``), the world size (``c.derived``) and the machine (``c.cuda``). Each rule reports
``<key>=<value>: <rule>; <fix>`` naming the key of this section it is about, and each rule has one owner: the
section of the key it is about. Defaults follow the MCPO-on-DAPO configuration of docs/algorithms.md §2;
``algorithm.name`` applies a preset (presets.py).

The sections live in :mod:`.sections`, one module per group:

=========================  ===============================================================
``sections.model``         model (and model.arch)
``sections.parallelism``   parallelism
``sections.rollout``       rollout (and rollout.partial), reshard, eval (the sampling rule of both)
``sections.algorithm``     algorithm (kl, tis, token_mask, sequence_mask, filter_groups, gcpo, mcpo)
``sections.data``          data, reward (overlong_buffer)
``sections.training``      optimizer, trainer, checkpoint, logging, diagnostics
``sections.tools``         tools (the Python tool: its sandbox and episodes)
=========================  ===============================================================

This module assembles them into :class:`Config` and re-exports every section class.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mcpo_megatron.config.sections.algorithm import (AlgorithmConfig, FilterGroupsConfig, GCPOConfig, HingeKLConfig,
                                                     KLConfig, MCPOConfig, SequenceMaskConfig, TISConfig,
                                                     TokenMaskConfig, hinge_is_inert)
from mcpo_megatron.config.sections.data import MIN_REWARD_MEMORY_MB, DataConfig, OverlongBufferConfig, RewardConfig
from mcpo_megatron.config.sections.model import ArchConfig, ModelConfig
from mcpo_megatron.config.sections.parallelism import ParallelismConfig
from mcpo_megatron.config.sections.rollout import (VLLM_ARGS_WITH_KEYS, EvalConfig, PartialRolloutConfig,
                                                   ReshardConfig, RolloutConfig, engine_memory_settings,
                                                   spare_groups, vllm_engine_arg_names)
from mcpo_megatron.config.sections.tools import ToolsConfig
from mcpo_megatron.config.sections.training import (CheckpointConfig, DiagnosticsConfig, LoggingConfig,
                                                    OffloadConfig, OptimizerConfig, TrainerConfig, WandbConfig,
                                                    offload_enabled)

__all__ = [
    "Config", "ModelConfig", "ArchConfig", "ParallelismConfig", "RolloutConfig", "PartialRolloutConfig",
    "ReshardConfig", "EvalConfig", "AlgorithmConfig", "KLConfig", "TISConfig", "TokenMaskConfig",
    "SequenceMaskConfig", "FilterGroupsConfig", "GCPOConfig", "MCPOConfig", "HingeKLConfig",
    "DataConfig", "RewardConfig", "OverlongBufferConfig", "OptimizerConfig", "TrainerConfig", "OffloadConfig",
    "CheckpointConfig", "LoggingConfig", "WandbConfig", "DiagnosticsConfig", "ToolsConfig",
    "hinge_is_inert", "engine_memory_settings", "spare_groups", "offload_enabled", "vllm_engine_arg_names", "VLLM_ARGS_WITH_KEYS",
    "MIN_REWARD_MEMORY_MB",
]


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reshard: ReshardConfig = field(default_factory=ReshardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    diagnostics: DiagnosticsConfig = field(default_factory=DiagnosticsConfig)
    tools: ToolsConfig = field(default_factory=ToolsConfig)
