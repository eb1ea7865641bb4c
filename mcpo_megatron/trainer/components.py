"""The one place that builds a run's components from its config: the model directory, the Megatron policy (and
``algorithm.kl``'s frozen reference), the rollout engine and the reward scorer. The training loop, ``mcpo eval``,
``mcpo export``, ``mcpo selftest`` and the checks build them here, so a setting means the same everywhere."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mcpo_megatron.config import Config
from mcpo_megatron.parallel.distributed import ParallelInfo, barrier

if TYPE_CHECKING:
    from mcpo_megatron.rollout.placement import RolloutPlacement


def resolve_model_dir(cfg: Config, info: ParallelInfo) -> str:
    """Local HF directory of ``model.path``; rank 0 materialises it (e.g. the builtin GGUF), others wait."""
    from mcpo_megatron.models.sources import resolve_model_path

    if info.rank == 0:
        path = resolve_model_path(cfg.model.path)
    barrier()
    if info.rank != 0:
        path = resolve_model_path(cfg.model.path)
    return str(path)


def torch_dtype(cfg: Config, device: torch.device) -> torch.dtype:
    """``model.dtype`` for weights on ``device`` (auto: bf16 on GPUs, fp32 on CPUs)."""
    if cfg.model.dtype == "bf16" or (cfg.model.dtype == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return torch.float32


def build_engine(cfg: Config, model_dir: str, hf_config, tokenizer, info: ParallelInfo, *,
                 load_weights: bool = False, role: str = "colocated"):
    """The rollout engine named by ``rollout.engine``. Without ``load_weights`` its weights come from the
    resharder (training: the first update overwrites every weight, so none is read from disk); with it, from
    ``model_dir`` (evaluating a model). ``role``: where a vLLM engine runs, which sets its share of the GPU
    (``VLLMRolloutEngine.from_config``): ``colocated`` with training, an ``engine_rank`` of its own, or
    ``standalone`` (``mcpo eval``)."""
    engine = _build_plain_engine(cfg, model_dir, hf_config, tokenizer, info, load_weights=load_weights, role=role)
    if not cfg.tools.enabled:
        return engine
    # tools.enabled: every sample is an episode with the Python tool (rollout/episodes.py), its calls run in the
    # sandbox of this rank (only the first rank of a tensor-parallel engine runs them)
    from mcpo_megatron import tools
    from mcpo_megatron.rollout.episodes import EpisodeEngine, EpisodeSettings

    sandbox = tools.from_config(cfg.tools) if engine.leads_engine() else None
    return EpisodeEngine(engine, sandbox, tokenizer, EpisodeSettings.from_config(cfg.tools))


def _build_plain_engine(cfg: Config, model_dir: str, hf_config, tokenizer, info: ParallelInfo, *,
                        load_weights: bool, role: str):
    if cfg.rollout.engine == "vllm":
        from mcpo_megatron.rollout.engines.vllm.engine import VLLMRolloutEngine  # imported lazily: an optional extra

        share = colocated_engine_share(cfg, info) if role == "colocated" else None
        return VLLMRolloutEngine.from_config(cfg, model_dir, load_format="auto" if load_weights else "dummy",
                                             role=role, gpu_memory_utilization=share)
    from mcpo_megatron.rollout.engines.torch.engine import TorchRolloutEngine

    kwargs = dict(dtype=torch_dtype(cfg, info.device), device=info.device,
                  max_batch_size=cfg.rollout.generation_batch_size, eos_token_ids=stop_token_ids(hf_config, tokenizer),
                  return_routed_experts=cfg.model.moe_routing_replay == "r3")
    if load_weights:
        return TorchRolloutEngine.from_pretrained(model_dir, **kwargs)
    return TorchRolloutEngine(hf_config, **kwargs)


def build_rollouts(cfg: Config, model_dir: str, hf_config, tokenizer, info: ParallelInfo,
                   bridge=None, *, offload=None, policy=None) -> RolloutPlacement:
    """Where the loop's generation batches are made: this rank's colocated engine, or (``rollout.placement=
    separate``) the ``rollout.ranks`` engine ranks behind ``bridge``, to which the ``policy``'s ranks send their
    shards (the reshard plan is compiled with the engine ranks here). With ``offload`` (:func:`build_offload`)
    the colocated engine is built while the training state is in host memory (vLLM sizes its memory against
    what is free when it starts), then sleeps and the state comes back."""
    if cfg.rollout.placement == "separate":
        from mcpo_megatron.rollout.separate.liveness import Waits
        from mcpo_megatron.rollout.separate.remote import RemoteRollouts

        return RemoteRollouts(bridge, engine_ranks=cfg.rollout.ranks, waits=Waits.from_config(cfg),
                              comm_device=info.device, model_chunks=policy.model_chunks if policy else None,
                              bucket_bytes=int(cfg.reshard.bucket_mb * 2**20))
    from mcpo_megatron.rollout.placement import LocalRollouts

    if offload is not None:
        offload.offload()
    engine = build_engine(cfg, model_dir, hf_config, tokenizer, info)
    # R3: the engine's routing stays on the replica that generated it until the trainer fetches its share
    rollouts = LocalRollouts(engine, rollout_tp=cfg.rollout.tensor_parallel_size, keep_routing_local=True,
                             offload=offload)
    if offload is not None:
        rollouts.after_rollouts()  # asleep until the first weight update; the state back for a resume to load
    return rollouts


def build_offload(cfg: Config, info: ParallelInfo, policy, reference=None):
    """``trainer.offload``: the policy's (and the reference's) state in host memory while a colocated engine
    generates, or None when it resolves off (null: on with GPUs and colocated engines)."""
    from mcpo_megatron.config import offload_enabled

    if not offload_enabled(cfg, cuda=info.device.type == "cuda"):
        return None
    from mcpo_megatron.models.offload import OffloadParts, StateOffload

    return StateOffload(policy, reference, OffloadParts.from_config(cfg.trainer.offload), device=info.device)


def build_scorer(cfg: Config):
    """The reward scorer of ``reward``: math-verify in ``reward.num_workers`` killable worker processes."""
    from mcpo_megatron.rewards import Grading, MathVerifyScorer

    r = cfg.reward
    grading = Grading(r.answer_format, correct_score=r.correct_score, incorrect_score=r.incorrect_score)
    return MathVerifyScorer(r.num_workers, r.timeout_s, r.memory_mb, grading=grading)


def colocated_engine_share(cfg: Config, info: ParallelInfo) -> float | None:
    """A colocated vLLM engine's share of this rank's GPU when ``rollout.gpu_memory_utilization`` is null: as
    ``mcpo plan`` resolves it for this GPU's memory (with trainer.offload what the rollout phase leaves free beside
    the reserve and what stays of the training state; without, 0.6). None when the value is set, or on CPU (vLLM's
    CPU build sizes its KV cache by its own budget)."""
    if cfg.rollout.gpu_memory_utilization is not None or info.device.type != "cuda":
        return None
    from mcpo_megatron.planner import colocated_engine_share as planned_share

    total = torch.cuda.get_device_properties(info.device).total_memory
    return planned_share(cfg, info.world_size, total, cuda=True)


def policy_settings(cfg: Config, info: ParallelInfo):
    """How the policy (and its reference) computes and steps, from the config: the optimizer and LR schedule (decay
    over all optimizer steps), the micro-batch budget and kernel chunk, the rollout's temperature, the layout's
    sequence parallelism and overlaps (on with CUDA unless set), packing, recomputation and the MoE options."""
    from mcpo_megatron.config import derived
    from mcpo_megatron.models.optim import OptimSettings
    from mcpo_megatron.models.policy_settings import PolicySettings

    steps_per_global = max(1, derived(cfg, info.world_size).optimizer_steps_per_global_step)
    p, cuda = cfg.parallelism, info.device.type == "cuda"
    return PolicySettings(
        dtype=torch_dtype(cfg, info.device),
        optim=OptimSettings.from_config(cfg, optimizer_steps=cfg.trainer.total_steps * steps_per_global),
        max_tokens_per_microbatch=cfg.trainer.max_tokens_per_microbatch,
        logprob_chunk_size=cfg.trainer.logprob_chunk_size, temperature=cfg.rollout.temperature,
        transformer_impl=cfg.model.transformer_impl, sequence_parallel=p.sequence_parallel,
        recompute_activations=cfg.model.recompute_activations, moe_aux_loss_coeff=cfg.model.moe_aux_loss_coeff,
        overlap_grad_reduce=on_gpu_by_default(p.overlap_grad_reduce, cuda),
        overlap_param_gather=on_gpu_by_default(p.overlap_param_gather, cuda) and p.use_distributed_optimizer,
        moe_routing_replay=cfg.model.moe_routing_replay, sequence_packing=cfg.trainer.sequence_packing)


def build_policy(cfg: Config, model_dir: str, info: ParallelInfo, hf_config=None, *, load_weights: bool = True):
    """The Megatron policy with the config's settings (:func:`policy_settings`)."""
    from mcpo_megatron.models.policy import MegatronPolicy

    return MegatronPolicy(model_dir, policy_settings(cfg, info), parallel_info=info, hf_config=hf_config,
                          load_weights=load_weights)


def on_gpu_by_default(value: bool | None, cuda: bool) -> bool:
    """A setting whose null means "on with CUDA, off on CPU"."""
    return cuda if value is None else bool(value)


def eval_context(cfg: Config, hf_config) -> tuple[int, str, str]:
    """(tokens, description, fix) of the context an eval prompt and its response must fit in: the vLLM engine's
    max_model_len (it refuses longer prompts and cuts responses at it), else the model's positions."""
    if cfg.rollout.engine == "vllm":
        from mcpo_megatron.rollout.engines.vllm.engine import run_max_model_len

        n = run_max_model_len(cfg)
        return (n, f"the vLLM engine's max_model_len={n} (data.max_prompt_length={cfg.data.max_prompt_length} + "
                   "the longer of rollout.max_new_tokens and eval's response cap)",
                "raise data.max_prompt_length, lower eval.max_new_tokens, or evaluate on shorter problems")
    n = int(getattr(hf_config, "max_position_embeddings", 0) or 0) or 2**62
    return (n, f"the model's max_position_embeddings={n}",
            "lower eval.max_new_tokens or evaluate on shorter problems")


def build_reference(cfg: Config, model_dir: str, info: ParallelInfo, hf_config=None):
    """The frozen reference policy of ``algorithm.kl``: ``model.path``'s weights (the run's starting point, also
    when resuming) on the policy's layout, computing log-probs exactly as the policy does."""
    from mcpo_megatron.models.reference import ReferencePolicy

    return ReferencePolicy(model_dir, policy_settings(cfg, info), parallel_info=info, hf_config=hf_config)


def stop_token_ids(hf_config, tokenizer) -> list[int]:
    ids = set()
    for source in (getattr(hf_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(int(x) for x in source)
    return sorted(ids)
