"""vLLM requests and outputs: one request per (prompt, sample), its completion as a :class:`RolloutSample`.

Determinism.  Each (prompt, sample) pair is submitted as its own request with ``n=1`` and
``seed=sample_seed(seed, j, i)``: vLLM then draws that request's noise from its own generator, so samples do not
depend on the replica split or on what else is batched, and every rank of a TP group draws the same tokens.
Pure functions of vLLM's objects (``vllm.SamplingParams`` is passed in), unit-tested with fakes.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from mcpo_megatron.rollout.engines.interface import (
    FINISH_LENGTH,
    FINISH_STOP,
    RolloutOutput,
    RolloutSample,
    SamplingParams,
    sample_seed,
)


def text_stop_params(sampling: SamplingParams) -> dict:
    """vLLM's request keys for ``sampling.stop_strings`` (none without them: requests are not detokenized). Stop
    strings need vLLM's detokenizer (vllm/sampling_params.py:734 of 0.32 refuses them with detokenize=False); the
    tokens after the one completing a stop string are dropped (vllm/v1/engine/detokenizer.py:148-151)."""
    if not sampling.stop_strings:
        return {"detokenize": False}
    return {"detokenize": True, "stop": list(sampling.stop_strings), "include_stop_str_in_output": True}


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
    text_stop = text_stop_params(sampling)
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
                skip_special_tokens=False,
                **text_stop,
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
