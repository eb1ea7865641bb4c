"""The vLLM rollout engine, colocated with training (GPU only; written against vLLM 0.33.0).

vLLM is imported lazily inside functions so this module imports anywhere.  The
engine is a thin wrapper over vLLM's own features:

* ``LLM(..., distributed_executor_backend="external_launcher")``: vLLM runs
  inside the training processes started by torchrun/srun and joins the
  existing ``torch.distributed`` world.  Consecutive groups of
  ``rollout_tp`` ranks form one tensor-parallel engine (vLLM arranges the world
  as ``[-1, pp=1, tp]``); the rest is rollout data parallelism, handled by
  :func:`~mcpo_megatron.rollout.engine.generate_data_parallel` (every rank of
  one replica passes the same prompts).  External-launcher mode runs one
  scheduler per rank, so all randomness is per request (below).
* ``enable_sleep_mode=True``: :meth:`VLLMRolloutEngine.sleep` releases the KV
  cache and the weights (level 1 offloads weights to CPU; level 2, the default
  here, discards them because the next update rewrites every weight; vLLM
  saves and restores the model buffers, e.g. rotary tables, itself).
  :meth:`VLLMRolloutEngine.wake_up` restores the weights only; the KV cache is
  re-allocated at the first ``generate`` so the weight update runs with the
  least memory in use.
* Weights are updated in place with ``LLM.apply_model(lambda m:
  m.load_weights(bucket))``: vLLM's model loaders take Hugging Face names and
  full tensors, fuse q/k/v and gate/up and slice each rank's TP shard.  The
  prefix cache is reset after an update (its KV was computed with old weights).
* Log-probs: ``logprobs_mode="processed_logprobs"`` (an engine argument) with
  ``SamplingParams(logprobs=0)`` returns the sampled token's log-prob under the
  processed distribution (temperature, then top-k/top-p), the definition in
  :mod:`mcpo_megatron.rollout.engine`.
* Seeds: each (prompt, sample) pair is submitted as its own request with
  ``n=1`` and ``seed=sample_seed(seed, j, i)``, so samples do not depend on the
  replica split and every rank of a TP group draws the same tokens.

Pure helpers (argument building, request building, output conversion) are
unit-tested on CPU with fakes of vLLM's objects.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Sequence

import torch

from mcpo_megatron.rollout.engine import (
    FINISH_LENGTH,
    FINISH_STOP,
    RolloutEngine,
    RolloutOutput,
    RolloutSample,
    SamplingParams,
    sample_seed,
)

log = logging.getLogger(__name__)

VLLM_VERSION = "0.33.0"
LOGPROBS_MODE = "processed_logprobs"
_DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
           "fp32": "float32", "float32": "float32", "auto": "auto"}


def build_llm_kwargs(
    model_dir: str,
    *,
    rollout_tp: int = 1,
    gpu_memory_utilization: float = 0.5,
    seed: int = 0,
    dtype: str = "bfloat16",
    max_model_len: int | None = None,
    enforce_eager: bool = False,
    load_format: str = "auto",
    enable_prefix_caching: bool = True,
    enable_sleep_mode: bool = True,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM`` (colocated, SPMD, sleep mode, processed log-probs).

    ``load_format="dummy"`` skips reading weights from disk (random init); the first
    reshard then provides every weight.
    """
    if rollout_tp < 1:
        raise ValueError(f"rollout.tensor_parallel_size={rollout_tp!r} must be >= 1")
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(
            f"rollout.gpu_memory_utilization={gpu_memory_utilization!r} must be in (0, 1]; it is the "
            "fraction of GPU memory vLLM may take for weights + KV cache while awake"
        )
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {sorted(_DTYPES)}")
    kwargs: dict[str, Any] = dict(
        model=str(model_dir),
        tokenizer=str(model_dir),
        tensor_parallel_size=int(rollout_tp),
        distributed_executor_backend="external_launcher",
        enable_sleep_mode=bool(enable_sleep_mode),
        gpu_memory_utilization=float(gpu_memory_utilization),
        seed=int(seed),
        dtype=_DTYPES[dtype],
        enforce_eager=bool(enforce_eager),
        load_format=load_format,
        enable_prefix_caching=bool(enable_prefix_caching),
        logprobs_mode=LOGPROBS_MODE,
    )
    if max_model_len is not None:
        kwargs["max_model_len"] = int(max_model_len)
    if extra:
        kwargs.update(extra)
    return kwargs


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
        samples.append(RolloutSample(prompt_index=j, sample_index=i, token_ids=tokens,
                                     logprobs=logprobs, finish_reason=reason))
    return RolloutOutput(samples)


class VLLMRolloutEngine(RolloutEngine):
    """vLLM colocated in the training processes (see the module docstring).

    Args:
        model_dir: a Hugging Face directory (config + tokenizer; weights unless
            ``load_format="dummy"``).
        eos_token_ids: ids that always stop a response (added to every request's
            stop ids; vLLM also stops at the tokenizer's EOS).
        sleep_level: 2 (discard weights; the next update rewrites all of them) or 1
            (offload to CPU; use when some weights are not part of the update).
        llm: an existing ``vllm.LLM`` (tests pass a fake); built from
            :func:`build_llm_kwargs` ``(**llm_kwargs)`` otherwise.
    """

    accepts_tp_shards = False  # vLLM's loaders slice full HF tensors themselves

    def __init__(self, model_dir: str, *, eos_token_ids: Sequence[int] = (), sleep_level: int = 2,
                 llm=None, sampling_params_cls=None, **llm_kwargs):
        if sleep_level not in (1, 2):
            raise ValueError(f"sleep_level={sleep_level!r} must be 1 or 2")
        if llm is None:
            from vllm import LLM

            llm = LLM(**build_llm_kwargs(model_dir, **llm_kwargs))
        if sampling_params_cls is None:
            from vllm import SamplingParams as VSamplingParams

            sampling_params_cls = VSamplingParams
        self.llm = llm
        self.sleep_enabled = bool(llm_kwargs.get("enable_sleep_mode", True))
        self._sp_cls = sampling_params_cls
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        self.sleep_level = sleep_level
        self._weights_asleep = False
        self._kv_asleep = False

    def generate(self, prompts_token_ids, sampling: SamplingParams, *, prompt_indices=None) -> RolloutOutput:
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
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        return convert_outputs(outs, keys)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self._weights_asleep:
            raise RuntimeError("VLLMRolloutEngine.update_weights called while asleep; call wake_up() first")
        bucket = list(named_tensors)
        if not bucket:
            return
        self.llm.apply_model(lambda model: model.load_weights(iter(bucket)))

    def finish_update(self) -> None:
        """Drop prefix-cache entries computed with the old weights (called by ``Resharder.push``)."""
        self.llm.reset_prefix_cache()

    @classmethod
    def from_config(cls, cfg, model_dir: str) -> "VLLMRolloutEngine":
        """Build from the run config (rollout.*, model.dtype, data.max_prompt_length)."""
        from transformers import AutoConfig

        eos = getattr(AutoConfig.from_pretrained(model_dir), "eos_token_id", None)
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        r = cfg.rollout
        dtype = "bfloat16" if cfg.model.dtype in ("auto", "bf16") else cfg.model.dtype
        return cls(
            model_dir, eos_token_ids=eos_ids,
            rollout_tp=int(r.tensor_parallel_size), gpu_memory_utilization=float(r.gpu_memory_utilization),
            seed=int(r.seed), dtype=dtype, max_model_len=int(cfg.data.max_prompt_length + r.max_new_tokens),
            enable_sleep_mode=bool(r.enable_sleep_mode), extra={"max_num_seqs": int(r.max_num_seqs)},
        )

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
