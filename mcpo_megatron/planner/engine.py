"""The vLLM engine's share of a GPU: its weights at rollout TP, its allowance and the KV cache in the rest.

Engine: weights ``2 * P_total / rollout_tp`` bytes (all experts); KV cache per token ``2 (K, V) * L *
ceil(kv/rollout_tp) * head_dim * 2`` bytes; KV space = utilisation x device - engine weights - engine allowance.
A hybrid decoder (Qwen3.5, Qwen3-Next) keeps a KV cache only in its full-attention layers and, in each Gated DeltaNet
layer, a fixed recurrent state per sequence whatever its length (vLLM 0.32,
``MambaStateShapeCalculator.gated_delta_net_state_shape``, model_executor/layers/mamba/mamba_utils.py:280-301): a
convolution state of ``(K - 1) x (2 qk + v) / rollout_tp`` values in the model's dtype and a delta-rule state of
``nv / rollout_tp x dv x dk`` values in ``mamba_ssm_dtype`` (fp32 for Qwen3.5, whose config names it; vLLM reads
it there: model_executor/models/config.py:853-878; the model's dtype otherwise). A sequence of ``n`` tokens then
takes ``n x kv_bytes_per_token + state_bytes_per_sequence``; vLLM also rounds each state up to the attention's
page size (its hybrid allocator), which this does not count.
A colocated engine takes ``rollout.gpu_memory_utilization`` of the device (vLLM reserves that fraction), an engine
rank of its own (``rollout.placement=separate``) ``rollout.dedicated_gpu_memory_utilization``. A standalone engine
(``mcpo eval``) takes the smallest ``rollout_tp`` whose KV space holds ``STANDALONE_MIN_SEQUENCES`` sequences of
the longest length (:func:`smallest_engine_tp`).
"""

from __future__ import annotations

from typing import Any

from mcpo_megatron.accounting import layer_kinds
from mcpo_megatron.config.shapes import FULL_ATTENTION, LINEAR_ATTENTION
from mcpo_megatron.planner.common import GIB, cfg_get
from mcpo_megatron.planner.counts import param_counts

ENGINE_ALLOWANCE_GIB = 2.0       # vLLM activation profile + CUDA graphs inside its utilisation budget
ENGINE_ASLEEP_GIB = 0.5          # what a sleeping vLLM engine keeps on the GPU
# A standalone engine (mcpo eval) takes the smallest TP whose KV cache holds this many full-length sequences: one
# problem's 8 samples generating together at the longest length; fewer would serialise long generations.
STANDALONE_MIN_SEQUENCES = 8
DEFAULT_UTILIZATION = 0.6        # a colocated engine's share beside the resident training state, when not set



def estimate_engine_memory(shape: Any, cfg: Any, world: int, gpu_mem_bytes: float, *,
                           utilization: float | None = None) -> dict[str, float]:
    """Per-GPU engine of a training run: its budget, weights at rollout TP, allowance, KV cache and its capacity
    (:func:`engine_memory`). A colocated engine takes ``utilization`` of the GPU (the planner resolves a null
    ``rollout.gpu_memory_utilization``: ``phases.colocated_share``), else the configured value; an engine rank of
    its own (``rollout.placement=separate``) ``rollout.dedicated_gpu_memory_utilization``, the share it is built
    with (``config.engine_memory_settings``)."""
    from mcpo_megatron.config import engine_memory_settings

    dedicated = cfg_get(cfg, "rollout.placement", "colocated") == "separate"
    util, _ = engine_memory_settings(cfg_get(cfg, "rollout", {}), dedicated=dedicated)
    if not dedicated and utilization is not None:
        util = utilization
    if util is None:
        util = DEFAULT_UTILIZATION
    max_len = int(cfg_get(cfg, "data.max_prompt_length", 0)) + int(cfg_get(cfg, "rollout.max_new_tokens", 0))
    return engine_memory(shape, rollout_tp=int(cfg_get(cfg, "rollout.tensor_parallel_size", 1)), utilization=util,
                         gpu_mem_bytes=gpu_mem_bytes, max_len=max_len)

def engine_memory(shape: Any, *, rollout_tp: int, utilization: float, gpu_mem_bytes: float,
                  max_len: int) -> dict[str, float]:
    """One GPU of a vLLM engine at ``rollout_tp`` taking ``utilization`` of ``gpu_mem_bytes``.

    Keys (bytes unless named otherwise): budget, weights, allowance, kv_cache, kv_bytes_per_token,
    state_bytes_per_sequence (a hybrid decoder's recurrent states; 0 otherwise), kv_tokens, max_sequence_length,
    full_length_sequences (sequences of ``max_len`` tokens the engine's KV cache holds), utilization,
    rollout_tp.
    """
    total = param_counts(shape, 1, 1)["total"]
    budget = utilization * gpu_mem_bytes
    weights = total * 2 / rollout_tp
    allowance = ENGINE_ALLOWANCE_GIB * GIB
    kv = budget - weights - allowance
    kv_heads = -(-shape.num_key_value_heads // rollout_tp)  # vLLM replicates KV heads when rollout TP > kv heads
    attention_layers = sum(k == FULL_ATTENTION for k in layer_kinds(shape))
    per_token = 2 * attention_layers * kv_heads * shape.head_dim * 2
    state = recurrent_state_bytes(shape, rollout_tp)
    room = max(0.0, kv)
    sequences = room / (per_token * max_len + state) if max_len else float("inf")
    tokens = room / per_token if not state else sequences * max_len
    return dict(budget=budget, weights=weights, allowance=allowance, kv_cache=kv, kv_bytes_per_token=per_token,
                state_bytes_per_sequence=state, kv_tokens=tokens, max_sequence_length=max_len,
                full_length_sequences=sequences, utilization=utilization, rollout_tp=rollout_tp)

def recurrent_state_bytes(shape: Any, rollout_tp: int) -> float:
    """Bytes of one sequence's Gated DeltaNet states on one engine rank at ``rollout_tp``: every linear-attention
    layer's convolution state (the model's bf16) and delta-rule state (``shape.ssm_state_bytes`` a value); 0 for
    a model without such layers (see the module doc)."""
    layers = sum(k == LINEAR_ATTENTION for k in layer_kinds(shape))
    if not layers:
        return 0.0
    qk = shape.linear_num_key_heads * shape.linear_key_head_dim
    v = shape.linear_num_value_heads * shape.linear_value_head_dim
    conv = (shape.linear_conv_kernel_dim - 1) * (2 * qk + v) / rollout_tp * 2
    delta = (shape.linear_num_value_heads / rollout_tp * shape.linear_value_head_dim * shape.linear_key_head_dim
             * shape.ssm_state_bytes)
    return layers * (conv + delta)

def vllm_splits(shape: Any, rollout_tp: int) -> bool:
    """Whether vLLM can split the model over ``rollout_tp`` ranks: TP must divide the attention heads and divide,
    or be a multiple of, the KV heads (the rules ``validate`` applies to ``rollout.tensor_parallel_size``)."""
    heads, kv = shape.num_attention_heads, shape.num_key_value_heads
    return heads % rollout_tp == 0 and (kv % rollout_tp == 0 or rollout_tp % kv == 0)

def smallest_engine_tp(shape: Any, *, gpus: int, gpu_mem_bytes: float, utilization: float, max_len: int,
                       min_sequences: int = STANDALONE_MIN_SEQUENCES) -> tuple[int, dict[str, float]]:
    """The smallest tensor-parallel size, at most ``gpus``, that vLLM can split the model into and whose KV cache
    holds ``min_sequences`` sequences of ``max_len`` tokens beside the weights (:func:`engine_memory`), with
    that size's engine; a standalone engine (``mcpo eval``) takes it. Raises ValueError with the best size's
    capacity when none does."""
    sizes = [t for t in range(1, max(1, gpus) + 1) if vllm_splits(shape, t)]
    engines = [engine_memory(shape, rollout_tp=t, utilization=utilization, gpu_mem_bytes=gpu_mem_bytes,
                             max_len=max_len) for t in sizes]
    for t, eng in zip(sizes, engines):
        if eng["full_length_sequences"] >= min_sequences:
            return t, eng
    best = max(engines, key=lambda e: e["full_length_sequences"])
    raise ValueError(
        f"no tensor-parallel size up to the {gpus} GPU(s) of {gpu_mem_bytes / GIB:.0f} GiB gives the engine room for "
        f"{min_sequences} sequences of {max_len} tokens at {utilization:g} of each GPU: at TP={best['rollout_tp']} "
        f"the weights take {best['weights'] / GIB:.1f} GiB per GPU and the KV cache holds "
        f"{best['full_length_sequences']:.1f}; use more GPUs, shorter limits (data.max_prompt_length, "
        "eval.max_new_tokens, rollout.max_new_tokens), or name a size with --tensor-parallel-size")
