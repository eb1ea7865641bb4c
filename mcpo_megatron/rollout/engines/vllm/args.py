"""The vLLM engine's arguments: what a run chooses (:class:`EngineSettings`) as ``vllm.LLM``'s keyword arguments
on vLLM's platform (:func:`build_llm_kwargs`), and the limits vLLM's builds have, refused naming them.

Determinism on CPU.  vLLM rewinds a request's generator when it throws away the token sampled after a *partial*
prefill (chunked prefill), and CPU generators cannot rewind ("CPU Generator does not use offset"), so on CPU the
engine makes the step token budget (``max_num_batched_tokens``) hold ``max_num_seqs`` full-length sequences: every
prompt is then prefilled in one step and nothing is ever rewound.  On CPU the KV cache is sized the same way
(``max_num_seqs`` x ``max_model_len`` tokens, :func:`kv_cache_bytes`) instead of as a fraction of host RAM, so no
request is ever preempted either.

Log-probs: ``logprobs_mode="processed_logprobs"`` (an engine argument) with ``SamplingParams(logprobs=0)``
returns the sampled token's log-prob under the processed distribution (temperature, then top-k/top-p), the
definition in :mod:`mcpo_megatron.rollout.engines.interface`.

What only vLLM's CUDA build does, decided here for an engine that the project steps itself (the external launcher:
colocated and engine-rank roles); a standalone engine (``own_workers``, ``mcpo eval``) keeps vLLM's defaults
(docs/decisions.md, "The vLLM engine on GPUs"; docs/verification.md, "Behaviour only CUDA shows"):

* ``async_scheduling=False``. On CUDA vLLM 0.32 turns asynchronous scheduling on by default
  (``config/vllm.py`` 1585-1644; the external launcher's executor supports it, ``v1/executor/uniproc_executor.py``
  156-158), and the engine core then keeps one scheduled batch in flight (``v1/engine/core.py`` 698-812): a step
  returns the tokens of the batch scheduled one step earlier. A session's segment would then end with a batch in
  flight, whose tokens come out in the next segment, stamped with that segment's version although the previous
  weights computed them, and a first segment of one step would return no token. Its CPU build forces it off
  (``platforms/cpu.py`` 329-331), so this is what the CPU tests assert too.
* ``disable_custom_all_reduce=True`` when the GPUs this process sees do not hold whole tensor-parallel groups of
  the engine (:func:`custom_all_reduce_fits`): vLLM's custom all-reduce indexes the visible devices by TP rank.
* ``moe_backend="triton"`` for an unquantized MoE model (:func:`unquantized_moe`): the reshard plan writes Triton's
  expert layout in place; vLLM's default on Blackwell is FlashInfer's, whose layout it does not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

VLLM_VERSION = "0.32.0"
LOGPROBS_MODE = "processed_logprobs"
_DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
           "fp32": "float32", "float32": "float32", "auto": "auto"}
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
CPU_KV_BLOCK = 128  # vLLM's CPU backend default block size (tokens)


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


@dataclass(frozen=True)
class EngineSettings:
    """The engine arguments a run chooses (``rollout.*``, the model's dtype, the longest sequence), checked on
    construction; :func:`build_llm_kwargs` adds what the platform and the engine's role decide.

    ``enforce_eager`` None: eager on CPU (compiling would cost minutes of start-up), CUDA graphs on GPUs.
    ``load_format="dummy"`` skips reading weights from disk (random init); the first reshard then provides every
    weight.  ``max_num_batched_tokens`` (tokens per engine step) None: vLLM's own on GPUs; on CPU it must hold
    every prompt whole (module docstring).  ``kv_cache_bytes``: the KV cache on CPU, required there with
    ``max_model_len`` (:func:`kv_cache_bytes`).  ``tokenizer=False`` starts vLLM without one (requests are token
    ids and responses are not detokenized, so it needs none).  ``return_routed_experts``
    (``model.moe_routing_replay=r3``) makes every completion carry the experts each token was routed to (vLLM's
    ``enable_return_routed_experts``: GPU model runner V2 only, with prefix caching; refused on CPU, naming the
    limit).  ``extra`` holds any other vLLM engine argument (``rollout.engine_kwargs``).
    """

    rollout_tp: int = 1
    gpu_memory_utilization: float = 0.5
    seed: int = 0
    dtype: str = "bfloat16"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    enforce_eager: bool | None = None
    load_format: str = "auto"
    enable_prefix_caching: bool = True
    enable_sleep_mode: bool = True
    max_num_batched_tokens: int | None = None
    kv_cache_bytes: int | None = None
    tokenizer: bool = True
    return_routed_experts: bool = False
    batch_invariant: bool = False
    extra: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.rollout_tp < 1:
            raise ValueError(f"rollout.tensor_parallel_size={self.rollout_tp!r} must be >= 1")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"rollout.gpu_memory_utilization={self.gpu_memory_utilization!r} must be in (0, 1]; it is the "
                "fraction of GPU memory vLLM may take for weights + KV cache while awake"
            )
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not one of {sorted(_DTYPES)}")
        if self.max_num_seqs < 1:
            raise ValueError(f"rollout.max_num_seqs={self.max_num_seqs!r} must be >= 1")


def build_llm_kwargs(model_dir: str, settings: EngineSettings, *, device: str = "cuda", own_workers: bool = False,
                     weight_transfer_backend: str | None = None, visible_gpus: int | None = None,
                     unquantized_moe: bool = False) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM`` (SPMD in the caller's processes, processed log-probs).

    ``device`` is vLLM's platform: ``"cuda"`` or ``"cpu"``.  On CPU, vLLM has no sleep mode
    (``enable_sleep_mode`` is dropped), and the step token budget and the KV cache hold ``max_num_seqs`` full
    sequences (module docstring).  ``own_workers``: the engine is not part of the caller's processes but vLLM's
    own executor runs it (one process at TP=1, a worker process per GPU at TP > 1), for a standalone engine
    (``mcpo eval``); without it every caller process is one rank of the engine (vLLM's external launcher), and the
    project steps it: synchronous scheduling, and on CUDA the custom all-reduce and MoE kernel of the module
    docstring, decided from ``visible_gpus`` (the CUDA devices this process sees) and ``unquantized_moe``
    (:func:`unquantized_moe` of the model).  ``weight_transfer_backend``: vLLM's weight-transfer backend of an
    engine the trainer updates.
    """
    s = settings
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device={device!r} must be 'cuda' or 'cpu' (vLLM's platform)")
    cpu = device == "cpu"
    if cpu and (s.max_model_len is None or s.kv_cache_bytes is None):
        raise ValueError("on CPU the vLLM engine needs max_model_len and kv_cache_bytes (see kv_cache_bytes())")
    if cpu and s.batch_invariant:
        raise ValueError(f"rollout.batch_invariant=true needs vLLM's CUDA build: vLLM {VLLM_VERSION}'s batch-invariant "
                         "kernels are GPU kernels (Triton, cuBLAS settings). On CPU the engine's samples already do "
                         "not depend on the batch (docs/verification.md); set rollout.batch_invariant=false")
    stepped = not own_workers
    kwargs: dict[str, Any] = dict(
        model=str(model_dir),
        tensor_parallel_size=int(s.rollout_tp),
        gpu_memory_utilization=float(s.gpu_memory_utilization),
        seed=int(s.seed),
        dtype=_DTYPES[s.dtype],
        enforce_eager=bool(cpu if s.enforce_eager is None else s.enforce_eager),
        load_format=s.load_format,
        enable_prefix_caching=bool(s.enable_prefix_caching),
        logprobs_mode=LOGPROBS_MODE,
        max_num_seqs=int(s.max_num_seqs),
    )
    if stepped:
        kwargs["distributed_executor_backend"] = "external_launcher"
        kwargs["async_scheduling"] = False  # every engine step's tokens are that step's (module docstring)
    if s.tokenizer:
        kwargs["tokenizer"] = str(model_dir)
    else:
        kwargs["skip_tokenizer_init"] = True
    if not cpu:
        kwargs["enable_sleep_mode"] = bool(s.enable_sleep_mode)
    if s.max_model_len is not None:
        kwargs["max_model_len"] = int(s.max_model_len)
    if cpu:
        kwargs.update(_cpu_budget(s))
    elif s.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = int(s.max_num_batched_tokens)
    if stepped and not cpu:
        if not custom_all_reduce_fits(s.rollout_tp, visible_gpus):
            kwargs["disable_custom_all_reduce"] = True
        if unquantized_moe:
            kwargs["moe_backend"] = "triton"
    if weight_transfer_backend is not None:
        kwargs["weight_transfer_config"] = {"backend": weight_transfer_backend}
    if s.return_routed_experts:
        check_routed_experts_support(device, s.enable_prefix_caching)
        kwargs["enable_return_routed_experts"] = True
    if s.extra:
        _check_extra(s.extra, kwargs, stepped)
        kwargs.update(s.extra)
    return kwargs


def _check_extra(extra: dict[str, Any], kwargs: dict[str, Any], stepped: bool) -> None:
    """Refuse a ``rollout.engine_kwargs`` argument that would undo what an engine the project steps needs."""
    if stepped and extra.get("async_scheduling"):
        raise ValueError(
            f"rollout.engine_kwargs.async_scheduling={extra['async_scheduling']!r}: an engine in the training "
            "processes is stepped by the trainer (sessions, segments, per-token versions, in-flight updates), which "
            f"needs every engine step to return its own tokens; vLLM {VLLM_VERSION}'s asynchronous scheduling returns "
            "them one step late. Remove the key (mcpo eval's standalone engine keeps vLLM's default)")
    if kwargs.get("disable_custom_all_reduce") and extra.get("disable_custom_all_reduce") is False:
        raise ValueError(
            "rollout.engine_kwargs.disable_custom_all_reduce=false: the GPUs this process sees do not hold whole "
            f"tensor-parallel groups of the engine (rollout.tensor_parallel_size={kwargs['tensor_parallel_size']}), "
            "and vLLM's custom all-reduce needs every GPU of its group visible; remove the key or give each task "
            "the GPUs of its engine")


def custom_all_reduce_fits(rollout_tp: int, visible_gpus: int | None) -> bool:
    """Whether vLLM's custom all-reduce can start in a process that sees ``visible_gpus`` CUDA devices (None:
    unknown, vLLM decides) and is one rank of an engine of ``rollout_tp`` ranks.

    vLLM checks peer access between the devices of its TP group by their TP ranks as indices into this process's
    visible devices (``distributed/device_communicators/custom_all_reduce.py`` 86-100, called at 280-289: by
    default through ``CUDA_VISIBLE_DEVICES``, ``VLLM_SKIP_P2P_CHECK`` being on, ``envs.py`` 1216; otherwise through
    a cache of the visible pairs only, ``all_reduce_utils.py`` 344-431), and maps the other ranks' buffers by CUDA
    IPC, which needs their GPUs visible. So it fits when the visible devices hold whole groups of consecutive
    ranks: every GPU visible (torchrun, srun without a binding), or k GPUs shared by k tasks with k a multiple of
    ``rollout_tp``. Under a binding of one GPU per task (or k < ``rollout_tp``) the check raises (IndexError or
    KeyError) at engine start; without custom all-reduce vLLM's TP all-reduce takes NCCL
    (``cuda_communicator.py`` 64-67, 157-166).
    """
    return rollout_tp <= 1 or visible_gpus is None or (visible_gpus >= rollout_tp and visible_gpus % rollout_tp == 0)


def unquantized_moe(hf_config) -> bool:
    """Whether ``hf_config`` is a mixture-of-experts model whose experts vLLM runs unquantized (no
    ``quantization_config``): the experts the reshard plan can write in place, with Triton's kernels."""
    experts = getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", None) or 0
    return int(experts) > 0 and getattr(hf_config, "quantization_config", None) is None


def _cpu_budget(s: EngineSettings) -> dict[str, int]:
    """The CPU engine's step token budget and KV cache: every prompt prefills in one step, so seeded requests never
    need a generator rewind (module docstring)."""
    whole = int(s.max_num_seqs) * int(s.max_model_len)
    if s.max_num_batched_tokens is not None and s.max_num_batched_tokens < whole:
        raise ValueError(
            f"rollout.max_num_batched_tokens={s.max_num_batched_tokens}: on CPU it must be at least "
            f"rollout.max_num_seqs x max_model_len = {whole} (a prompt prefilled in two steps would rewind a "
            "seeded CPU generator, which vLLM's CPU build cannot do); use null")
    return {"max_num_batched_tokens": s.max_num_batched_tokens or whole, "kv_cache_memory_bytes": int(s.kv_cache_bytes)}


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


def run_max_model_len(cfg) -> int:
    """The engine context of a run: ``data.max_prompt_length`` + the longer of the rollout and eval response
    caps (``rollout.max_new_tokens``; ``eval.max_new_tokens``, null: ``data.max_response_length``)."""
    longest = max(int(cfg.rollout.max_new_tokens), int(cfg.eval.max_new_tokens or cfg.data.max_response_length))
    return int(cfg.data.max_prompt_length) + longest


def plain_dict(mapping) -> dict:
    """A config mapping (an OmegaConf node or a dict) as plain Python containers."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(mapping, resolve=True) if OmegaConf.is_config(mapping) else dict(mapping)
