"""Per-GPU memory and preemption-lead estimates for a parallel layout on a cluster shape (``mcpo plan``,
commands/plan.py, prints them before a job queues).

The config is validated for ``world = nodes x gpus_per_node`` (``config.validate``); then the memory of the
busiest GPU is estimated for the two phases of a colocated step and compared with the device:

* **rollout**: the training state stays resident (bf16 weights, fp32 gradient buffer, the distributed
  optimizer's shard) while the engine uses ``rollout.gpu_memory_utilization`` of the device (vLLM reserves that
  fraction: its weights at rollout TP, its activation/CUDA-graph allowance, and the KV cache in the rest);
* **training**: the training state plus activations at the token budget ``trainer.max_tokens_per_microbatch``,
  the logits of one micro-batch and the vocab-parallel log-prob chunk; the engine sleeps (weights offloaded,
  KV cache freed).

A fixed reserve (CUDA context, NCCL buffers, allocator fragmentation) is added to both. A layout whose phase
total exceeds the device, or whose KV cache cannot hold one sequence of maximum length, is refused (exit 1)
naming the term that overflows and what to change. The estimates are first-order; the parameter, gradient and
optimizer terms are exact counts of megatron-core's tensors (tested against a built model on CPU).

Formulas (bytes; t = TP, p = PP, h = hidden, F = ffn hidden, V = vocab, T = tokens per micro-batch):

* parameters of the busiest pipeline stage on one TP rank: per layer ``(h*(q + 2*kv + q) + 3*h*F)/t`` linear
  weights (a mixture-of-experts layer instead of ``3*h*F/t``: its ``E/ep`` local experts of width ``I``,
  ``E/ep * 3*h*I/t`` (expert-TP = TP), plus the replicated router ``E*h``) (q = heads x head_dim, kv = query groups x head_dim, query groups padded to a multiple of t as
  megatron does) plus replicated norms (``2h``, and ``2*head_dim`` q/k norms for Qwen3, QKV biases for Qwen2),
  ``ceil(L/p)`` layers, the embedding ``V*h/t`` on the first stage and the output layer on the last (tied
  embeddings are shared only when p = 1);
* weights ``2 P`` (bf16; 4 with ``model.dtype=fp32``), gradients ``4 P`` (megatron DDP with
  ``grad_reduce_in_fp32``), optimizer ``(4 + 4 + 4) P / DP`` (fp32 master copy + Adam m and v, sharded over DP
  by the distributed optimizer; the master copy is omitted for fp32 weights; not divided without the
  distributed optimizer); expert parameters are sharded over the expert-data-parallel size
  ``world / (PP * ep * t)`` instead of DP;
* with ``algorithm.kl.enable`` the frozen reference policy: another ``2 P`` (weights only, same layout), resident
  in both phases;
* activations per token per layer: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
  Transformer Models", Eq. 2 (``sbh(10 + 24/t)`` bytes without sequence parallelism, ``34 sbh / t`` with it),
  re-derived for these models: no dropout, FlashAttention (no ``s^2`` scores; 4-byte softmax statistics per
  head), GQA, SwiGLU, Qwen3 q/k norms:
  ``2*(4h)`` replicated (norm inputs and linear inputs; divided by t with sequence parallelism) +
  ``2*(q + 2kv  +  (q + kv if q/k norms)  +  q  +  2F  +  F)/t`` + ``4*heads/t``; a MoE layer replaces the MLP
  terms ``2*(2F + F)/t`` by its k routed copies of each token, ``2*k*(2h + 3I/t)`` (permuted input, fc1 and
  activation outputs, expert output), and adds the fp32 router scores ``4*E``.
  The first stage holds ``p`` micro-batches in flight under 1F1B, each of ``ceil(L/p)`` layers; with ``v``
  virtual stages ``ceil(p * (1 + (p - 1) / (p * v)))`` (Narayanan et al. 2021, interleaved 1F1B; the estimate
  of Megatron-LM's ``theoretical_memory_usage``). With
  ``model.recompute_activations`` (full, uniform, 1 layer) only each layer's input (``2h`` per token, ``/t``
  with sequence parallelism) is kept, plus one layer's activations while it is recomputed;
* attention scores, with ``model.transformer_impl=local`` only (megatron's unfused ``DotProductAttention``: what
  runs on GPUs without Transformer Engine, and on CPUs): each layer also keeps the softmax probabilities of
  every query-key pair, ``heads/t * T * min(T, S)`` pairs for a micro-batch of ``T`` padded tokens whose
  sequences are at most ``S = data.max_prompt_length + data.max_response_length`` long, at 6 bytes a pair (the
  fp32 softmax output and its bf16 copy for the context matmul; 4 bytes in fp32, where they are one tensor),
  plus the layer's boolean causal mask, ``min(T, S)^2`` bytes, for the same layers and micro-batches in flight
  as the activations (one layer with recomputation);
  ``auto`` is planned as the Transformer Engine spec (FlashAttention), what GPU clusters install;
* logits of one micro-batch on the last stage: ``T * V/t * 2`` bytes, twice (value and gradient);
* activation and logit bytes double with ``model.dtype=fp32`` (``auto`` is planned as bf16: the GPU case);
* log-prob chunk: ``chunk * V/t * 4`` bytes x 3 fp32 copies (upcast logits, exp, gradient);
* engine: weights ``2 * P_total / rollout_tp`` (all experts); KV cache per token ``2 (K, V) * L * ceil(kv/rollout_tp) *
  head_dim * 2`` bytes; KV space = utilisation x device - engine weights - engine allowance. A standalone engine
  (``mcpo eval``) takes the smallest ``rollout_tp`` whose KV space holds ``STANDALONE_MIN_SEQUENCES`` sequences
  of the longest length (:func:`smallest_engine_tp`).

With ``rollout.placement=separate`` the two kinds of rank are planned apart: the training ranks (``world -
rollout.ranks``) hold the training state and activations, never an engine; the engine ranks hold the engine
(``rollout.dedicated_gpu_memory_utilization`` of the device, 0.9 by default: it has the GPU to itself) plus one
reshard bucket received from the trainer; the trainer's first rank keeps a host copy of the weights (``2 P_total``
bytes in bf16) from which the engines take each new version. :func:`suggest_split` then divides a launch between
the two from the step's generation and training work, measured (device-seconds of an earlier run) or estimated
(model FLOPs at an assumed MFU per phase: decoding reaches a lower one than training).

It also sizes the preemption lead time (``trainer/preemption.py``): a signal that arrives just after generation
waits for the old log-prob pass, the updates and a checkpoint. Worst case, every response at its maximum
length: model FLOPs (``accounting.model_flops``: a forward for the old log-probs, ``ppo_epochs`` x 3 forwards for
the updates) over ``world x peak x MFU`` (``--peak-tflops``, ``--mfu``), plus the checkpoint's bytes (bf16
weights, fp32 master weights and Adam moments: 14 bytes per parameter) at the file system's aggregate write
bandwidth (``--fs-write-gbps``). These are first-order figures; the trainer logs the measured worst case of each
step as ``time/preempt_lead_needed``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

GIB = 1024 ** 3
H100_PEAK_TFLOPS = 989.0         # dense bf16, one H100 SXM (accounting.H100_BF16_DENSE_PEAK)

# Fixed allowances (GiB). They are deliberately round numbers: measured values vary by driver, NCCL version
# and fragmentation; raise --reserve-gb on a cluster that needs more.
DEFAULT_RESERVE_GIB = 3.0        # CUDA context + NCCL buffers + allocator fragmentation, per GPU
DEFAULT_MFU = 0.35               # model FLOPs utilisation assumed for the step-time estimate
DEFAULT_GEN_MFU = 0.15           # ... for generation: decoding is bound by memory bandwidth, batches thin out
DEFAULT_FS_WRITE_GBPS = 5.0      # aggregate checkpoint write bandwidth assumed (GB/s)
CHECKPOINT_BYTES_PER_PARAM = 14  # bf16 weights + fp32 master weights + Adam m and v
ENGINE_ALLOWANCE_GIB = 2.0       # vLLM activation profile + CUDA graphs inside its utilisation budget
ENGINE_ASLEEP_GIB = 0.5          # what a sleeping vLLM engine keeps on the GPU
# A standalone engine (mcpo eval) takes the smallest TP whose KV cache holds this many full-length sequences: one
# problem's 8 samples generating together at the longest length; fewer would serialise long generations.
STANDALONE_MIN_SEQUENCES = 8


@dataclass(frozen=True)
class Term:
    """One line of the memory table."""

    name: str
    bytes: float
    note: str

    @property
    def gib(self) -> float:
        return self.bytes / GIB


@dataclass
class Plan:
    """The result of :func:`plan`: tables per phase, the device size and the reasons for a refusal. With separate
    placement ``training`` is the training ranks' table and ``rollout`` the engine ranks'."""

    world_size: int
    gpu_mem_bytes: float
    training: list[Term]
    rollout: list[Term]
    engine: dict[str, float]
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    separate: bool = False
    train_world_size: int = 0
    rollout_world_size: int = 0
    host_weights_bytes: float = 0.0   # separate: the trainer leader's host copy of the weights

    @property
    def ok(self) -> bool:
        return not self.errors

    @staticmethod
    def total(terms: list[Term]) -> float:
        return sum(t.bytes for t in terms)


# ------------------------------------------------------------------------------------------------
# Pure estimates
# ------------------------------------------------------------------------------------------------

def _get(cfg: Any, dotted: str, default: Any = None) -> Any:
    node = cfg
    for part in dotted.split("."):
        if node is None:
            return default
        node = node.get(part, None) if hasattr(node, "get") else getattr(node, part, None)
    return default if node is None else node


def padded_query_groups(kv_heads: int, tp: int) -> int:
    """Query groups megatron builds at TP ``tp``: ``kv_heads`` rounded up to a multiple of ``tp``."""
    return -(-kv_heads // tp) * tp


def _moe(shape: Any) -> tuple[int, int, int]:
    """(experts, experts per token, expert width) of a mixture-of-experts shape; (0, 0, 0) when dense."""
    experts = int(getattr(shape, "num_experts", 0) or 0)
    if not experts:
        return 0, 0, 0
    return experts, int(shape.num_experts_per_tok), int(shape.moe_ffn_hidden_size)


def layer_params_split(shape: Any, tp: int, ep: int = 1) -> tuple[int, int]:
    """(non-expert, expert) parameters of one decoder layer held by one TP (and EP) rank."""
    h, hd, f = shape.hidden_size, shape.head_dim, shape.ffn_hidden_size
    groups = padded_query_groups(shape.num_key_value_heads, tp)
    heads = groups * (shape.num_attention_heads // shape.num_key_value_heads)
    q, kv = heads * hd, groups * hd
    n = (h * (q + 2 * kv) + q * h) // tp                  # QKV, output projection
    n += 2 * h                                            # input and post-attention RMSNorm
    if shape.family in ("qwen3", "qwen3_moe"):
        n += 2 * hd                                       # q_norm, k_norm
    if shape.family == "qwen2":
        n += (q + 2 * kv) // tp                           # QKV biases
    experts, _, width = _moe(shape)
    if experts:
        return n + experts * h, experts // ep * 3 * h * width // tp   # replicated router; local experts
    return n + 3 * h * f // tp, 0                         # fc1 (gate; up), fc2


def layer_params_per_rank(shape: Any, tp: int, ep: int = 1) -> int:
    """Parameters of one decoder layer held by one TP rank (linear weights split, norms replicated; a MoE
    layer's experts split over EP and TP)."""
    return sum(layer_params_split(shape, tp, ep))


def param_counts(shape: Any, tp: int, pp: int, ep: int = 1) -> dict[str, int]:
    """Parameter counts: ``total`` (the HF model), per TP rank of the ``first`` and ``last`` pipeline stage,
    ``stage_max`` (the busiest stage), ``layers_per_stage``, and for MoE models ``expert_stage`` (the expert
    parameters of a stage on one rank, included in the stage counts) and ``total_active`` (parameters one token
    uses: k of E experts)."""
    h, v, layers = shape.hidden_size, shape.vocab_size, shape.num_layers
    per_stage = -(-layers // pp)
    dense, expert = layer_params_split(shape, tp, ep)
    layer = dense + expert
    emb = v * h // tp
    out = 0 if (shape.tie_word_embeddings and pp == 1) else v * h // tp
    first = per_stage * layer + emb + (out + h if pp == 1 else 0)
    last = per_stage * layer + out + h + (emb if pp == 1 else 0)
    full_dense, full_expert = layer_params_split(shape, 1, 1)
    head = v * h * (1 if shape.tie_word_embeddings else 2) + h
    total = layers * (full_dense + full_expert) + head
    experts, topk, _ = _moe(shape)
    active = layers * (full_dense + (full_expert * topk // experts if experts else 0)) + head
    return dict(total=total, first=first, last=last, stage_max=max(first, last), layers_per_stage=per_stage,
                layer=layer, expert_stage=per_stage * expert, total_active=active)


def activation_bytes_per_token_layer(shape: Any, tp: int, sequence_parallel: bool, dtype_bytes: int = 2) -> float:
    """Bytes one decoder layer keeps for backward per token, without recomputation (see the module doc).

    ``dtype_bytes`` is the activation element size (2 for bf16); the softmax statistics are always fp32.
    """
    h, hd, f = shape.hidden_size, shape.head_dim, shape.ffn_hidden_size
    groups = padded_query_groups(shape.num_key_value_heads, tp)
    heads = groups * (shape.num_attention_heads // shape.num_key_value_heads)
    q, kv = heads * hd, groups * hd
    replicated = dtype_bytes * 4 * h                      # norm inputs + QKV / fc1 linear inputs
    if sequence_parallel:
        replicated /= tp
    qk_norm = (q + kv) if shape.family in ("qwen3", "qwen3_moe") else 0
    experts, topk, width = _moe(shape)
    if experts:   # k routed copies: permuted input, fc1 (gate; up) and activation outputs, expert output
        mlp = dtype_bytes * topk * (2 * h + 3 * width / tp) + 4 * experts
    else:
        mlp = dtype_bytes * (2 * f + f) / tp
    split = dtype_bytes * (q + 2 * kv + qk_norm + q) / tp + mlp + 4 * heads / tp
    return replicated + split


def attention_score_bytes(shape: Any, tp: int, tokens: int, longest: int, dtype_bytes: int = 2) -> float:
    """Bytes of one layer's softmax probabilities kept for backward by the local spec's unfused attention, for
    a micro-batch of ``tokens`` padded tokens whose sequences are at most ``longest`` long (see the module doc).

    A micro-batch of ``b`` rows padded to ``s`` tokens holds ``b * s * s`` pairs per head; ``b * s <= tokens``
    and ``s <= min(tokens, longest)`` bound them by ``tokens * min(tokens, longest)``. The causal mask (one
    byte a pair, one ``s x s`` tensor for all rows and heads) is built by each layer and kept by its masked fill.
    """
    groups = padded_query_groups(shape.num_key_value_heads, tp)
    heads = groups * (shape.num_attention_heads // shape.num_key_value_heads) // tp
    per_pair = 4 + (dtype_bytes if dtype_bytes < 4 else 0)   # fp32 softmax output (+ its bf16 copy)
    s = min(tokens, longest)
    return float(heads * tokens * s * per_pair + s * s)


def _dtype_bytes(cfg: Any) -> int:
    return 4 if str(_get(cfg, "model.dtype", "auto")) == "fp32" else 2


def estimate_training_memory(shape: Any, cfg: Any, world: int) -> dict[str, Term]:
    """Per-GPU training-phase terms of the busiest pipeline stage (see the module docstring for formulas).

    Keys: weights, grads, optimizer, activations, logits, logprob_chunk, with ``algorithm.kl.enable``
    reference (the frozen reference policy's weights, split like the policy's), and with
    ``model.transformer_impl=local`` attention_scores (the unfused attention's softmax probabilities).
    """
    tp = int(_get(cfg, "parallelism.tensor_model_parallel_size", 1))
    pp = int(_get(cfg, "parallelism.pipeline_model_parallel_size", 1))
    ep = int(_get(cfg, "parallelism.expert_model_parallel_size", 1))
    vpp = int(_get(cfg, "parallelism.virtual_pipeline_model_parallel_size", 1) or 1)
    dp = max(1, world // (tp * pp))
    edp = max(1, world // (tp * pp * ep))                 # expert data parallel (expert-TP = TP)
    sp = bool(_get(cfg, "parallelism.sequence_parallel", False)) and tp > 1
    dist_opt = bool(_get(cfg, "parallelism.use_distributed_optimizer", True))
    recompute = bool(_get(cfg, "model.recompute_activations", False))
    reference = bool(_get(cfg, "algorithm.kl.enable", False))
    tokens = int(_get(cfg, "trainer.max_tokens_per_microbatch"))
    chunk = int(_get(cfg, "trainer.logprob_chunk_size"))
    unfused = str(_get(cfg, "model.transformer_impl", "auto")) == "local"
    longest = int(_get(cfg, "data.max_prompt_length", 0)) + int(_get(cfg, "data.max_response_length", 0))
    wbytes = _dtype_bytes(cfg)
    counts = param_counts(shape, tp, pp, ep)
    h, v = shape.hidden_size, shape.vocab_size
    expert = counts["expert_stage"]

    def stage_terms(params: int, in_flight: int, has_logits: bool) -> dict[str, Term]:
        opt_per_param = (8 if wbytes == 4 else 12)
        dense_div, expert_div = (dp, edp) if dist_opt else (1, 1)
        opt_bytes = (params - expert) * opt_per_param / dense_div + expert * opt_per_param / expert_div
        moe_note = (f", experts {expert / 1e9:.2f}B/GPU (EP={ep})" if expert else "")
        per_layer = activation_bytes_per_token_layer(shape, tp, sp, wbytes)
        layers = counts["layers_per_stage"]
        if recompute:
            kept = wbytes * h / (tp if sp else 1)
            act = tokens * (in_flight * layers * kept + per_layer)
            act_note = (f"recompute: {layers} layer inputs x {in_flight} micro-batch(es) in flight + 1 layer "
                        f"recomputed, {tokens} tokens")
        else:
            act = tokens * in_flight * layers * per_layer
            act_note = (f"{per_layer / 1024:.1f} KiB/token/layer x {layers} layers x {in_flight} in flight x "
                        f"{tokens} tokens")
        terms = {
            "weights": Term("weights", params * wbytes,
                            f"{params / 1e9:.2f}B params/GPU ({'fp32' if wbytes == 4 else 'bf16'}, TP={tp}, PP={pp}"
                            f"{moe_note})"),
            "grads": Term("grads", params * 4, "fp32 main-grad buffer (grad_reduce_in_fp32)"),
            "optimizer": Term("optimizer", opt_bytes,
                              ("fp32 master + " if wbytes == 2 else "") + "Adam m, v"
                              + (f" sharded over DP={dp}" if dist_opt else " (not sharded)")
                              + (f", experts over expert-DP={edp}" if dist_opt and expert else "")),
            "activations": Term("activations", act, act_note + (", sequence parallel" if sp else "")),
            "logits": Term("logits", tokens * v / tp * wbytes * 2 if has_logits else 0,
                           f"{tokens} x {v // tp} {'fp32' if wbytes == 4 else 'bf16'}, value + gradient" if has_logits else "not on this stage"),
            "logprob_chunk": Term("logprob_chunk", chunk * v / tp * 4 * 3 if has_logits else 0,
                                  f"{chunk} x {v // tp} fp32 x 3" if has_logits else "not on this stage"),
        }
        if unfused:
            pairs = attention_score_bytes(shape, tp, tokens, longest or tokens, wbytes)
            kept = 1 if recompute else in_flight * layers
            terms["attention_scores"] = Term(
                "attention_scores", pairs * kept,
                f"model.transformer_impl=local: unfused softmax probabilities, {pairs / GIB:.2f} GiB/layer x "
                + ("1 recomputed layer" if recompute else f"{layers} layers x {in_flight} in flight"))
        if reference:
            terms["reference"] = Term("reference", params * wbytes,
                                      "algorithm.kl: frozen reference policy, weights only, split like the policy")
        return terms

    in_flight = pp if vpp == 1 else math.ceil(pp * (1 + (pp - 1) / (pp * vpp)))
    first = stage_terms(counts["first"], in_flight, has_logits=(pp == 1))
    if pp == 1:
        return first
    last = stage_terms(counts["last"], 1, has_logits=True)
    return first if sum(t.bytes for t in first.values()) >= sum(t.bytes for t in last.values()) else last


def estimate_engine_memory(shape: Any, cfg: Any, world: int, gpu_mem_bytes: float) -> dict[str, float]:
    """Per-GPU engine of a training run: its budget, weights at rollout TP, allowance, KV cache and its capacity
    (:func:`engine_memory`). A colocated engine takes ``rollout.gpu_memory_utilization`` of the GPU; an engine rank
    of its own (``rollout.placement=separate``) ``rollout.dedicated_gpu_memory_utilization``, the share it is
    built with (``config.engine_memory_settings``)."""
    from mcpo_megatron.config import engine_memory_settings

    dedicated = _get(cfg, "rollout.placement", "colocated") == "separate"
    util, _ = engine_memory_settings(_get(cfg, "rollout", {}), dedicated=dedicated)
    max_len = int(_get(cfg, "data.max_prompt_length", 0)) + int(_get(cfg, "rollout.max_new_tokens", 0))
    return engine_memory(shape, rollout_tp=int(_get(cfg, "rollout.tensor_parallel_size", 1)), utilization=util,
                         gpu_mem_bytes=gpu_mem_bytes, max_len=max_len)


def engine_memory(shape: Any, *, rollout_tp: int, utilization: float, gpu_mem_bytes: float,
                  max_len: int) -> dict[str, float]:
    """One GPU of a vLLM engine at ``rollout_tp`` taking ``utilization`` of ``gpu_mem_bytes``.

    Keys (bytes unless named otherwise): budget, weights, allowance, kv_cache, kv_bytes_per_token,
    kv_tokens, max_sequence_length, full_length_sequences (sequences of ``max_len`` tokens the engine's KV cache
    holds), utilization, rollout_tp.
    """
    total = param_counts(shape, 1, 1)["total"]
    budget = utilization * gpu_mem_bytes
    weights = total * 2 / rollout_tp
    allowance = ENGINE_ALLOWANCE_GIB * GIB
    kv = budget - weights - allowance
    kv_heads = -(-shape.num_key_value_heads // rollout_tp)  # vLLM replicates KV heads when rollout TP > kv heads
    per_token = 2 * shape.num_layers * kv_heads * shape.head_dim * 2
    tokens = max(0.0, kv) / per_token
    return dict(budget=budget, weights=weights, allowance=allowance, kv_cache=kv, kv_bytes_per_token=per_token,
                kv_tokens=tokens, max_sequence_length=max_len,
                full_length_sequences=tokens / max_len if max_len else float("inf"), utilization=utilization,
                rollout_tp=rollout_tp)


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


def estimate_preempt_lead(shape: Any, cfg: Any, world: int, *, peak_flops: float,
                          mfu: float = DEFAULT_MFU, fs_write_gbps: float = DEFAULT_FS_WRITE_GBPS) -> dict[str, float]:
    """Seconds a preemption signal needs, worst case, to finish the step after generation and checkpoint
    (module docstring). Keys: train_flops, train_s, checkpoint_bytes, checkpoint_s, lead_s, suggested_lead_s."""
    from mcpo_megatron import accounting

    if not (peak_flops > 0 and 0 < mfu <= 1 and fs_write_gbps > 0):
        raise ValueError(f"peak_flops={peak_flops}, mfu={mfu}, fs_write_gbps={fs_write_gbps}: need peak > 0, "
                         "0 < mfu <= 1 and a bandwidth > 0")
    sequences = int(_get(cfg, "data.train_batch_size")) * int(_get(cfg, "rollout.n"))
    prompt, response = int(_get(cfg, "data.max_prompt_length")), int(_get(cfg, "data.max_response_length"))
    epochs = int(_get(cfg, "algorithm.ppo_epochs", 1))
    lengths = dict(prompt_lens=prompt, response_lens=response, num_sequences=sequences)
    flops = (accounting.model_flops(shape, kind="logprob", **lengths)
             + epochs * accounting.model_flops(shape, kind="train", **lengths))
    train_s = flops / (world * peak_flops * mfu)
    ckpt_bytes = param_counts(shape, 1, 1)["total"] * CHECKPOINT_BYTES_PER_PARAM
    ckpt_s = ckpt_bytes / (fs_write_gbps * 1e9)
    lead = train_s + ckpt_s
    return dict(train_flops=flops, train_s=train_s, checkpoint_bytes=ckpt_bytes, checkpoint_s=ckpt_s, lead_s=lead,
                suggested_lead_s=math.ceil((1.25 * lead + 60) / 60) * 60)


def format_preempt_lead(lead: dict[str, float], world: int, peak_flops: float, mfu: float,
                        fs_write_gbps: float) -> str:
    return "\n".join([
        "",
        "preemption lead (a signal just after generation, every response at its maximum length):",
        f"  old log-probs + updates: {lead['train_flops']:.3g} FLOP / ({world} GPUs x {peak_flops / 1e12:.0f} "
        f"TFLOP/s x MFU {mfu:g}) = {lead['train_s']:.0f} s",
        f"  checkpoint: {lead['checkpoint_bytes'] / 1e9:.0f} GB at {fs_write_gbps:g} GB/s = {lead['checkpoint_s']:.0f} s",
        f"  submit with SBATCH_SIGNAL=B:USR1@{int(lead['suggested_lead_s'])} (slurm/train.sbatch); the trainer logs "
        "the measured figure as time/preempt_lead_needed",
    ])


_FIXES = {
    "weights": "raise parallelism.tensor_model_parallel_size or pipeline_model_parallel_size",
    "grads": "raise parallelism.tensor_model_parallel_size or pipeline_model_parallel_size",
    "optimizer": "use more GPUs (a larger DP shards it further; for experts a larger world / (PP x EP x TP)), or "
                 "parallelism.use_distributed_optimizer=true where it is off",
    "activations": "lower trainer.max_tokens_per_microbatch, set model.recompute_activations=true, "
                   "parallelism.sequence_parallel=true, or raise TP/PP",
    "attention_scores": "use the Transformer Engine layer spec (transformer-engine installed, model.transformer_impl="
                        "auto: FlashAttention keeps no scores), lower trainer.max_tokens_per_microbatch, or set "
                        "model.recompute_activations=true",
    "logits": "lower trainer.max_tokens_per_microbatch or raise parallelism.tensor_model_parallel_size",
    "logprob_chunk": "lower trainer.logprob_chunk_size",
    "reference": "raise parallelism.tensor_model_parallel_size or pipeline_model_parallel_size (the reference is "
                 "split like the policy), or set algorithm.kl.enable=false",
    "engine": "lower rollout.gpu_memory_utilization (the engine reserves that fraction of the GPU while the "
              "training state stays resident)",
    "reserve": "use a larger GPU or lower --reserve-gb if the cluster really needs less",
    "routing": "lower trainer.max_tokens_per_microbatch, or set model.moe_routing_replay=off",
}


def estimate_routing_record(shape: Any, cfg: Any, world: int) -> dict[str, float] | None:
    """MoE routing replay's record (``model.moe_routing_replay`` r2 / r3; None when off or dense): int16 expert
    indices, tokens x MoE layers x top-k, in host memory at full length: R2 for this DP rank's sequences; R3 the
    larger of the sequences this rank's rollout replica generated and its DP share plus one transfer chunk
    (the trainer's fetch_routing; with dynamic sampling a replica holds the routing of every generation
    batch until the step's groups are chosen).  On the GPU: one micro-batch's int64 indices
    (``trainer.max_tokens_per_microbatch`` tokens, this TP rank's slice with sequence parallelism) for every layer.
    Keys: device_bytes, host_bytes, sequences (per rank), tokens_per_sequence, bytes_per_token (host)."""
    experts, topk, _ = _moe(shape)
    if not experts or str(_get(cfg, "model.moe_routing_replay", "off")) == "off":
        return None
    from mcpo_megatron.models.routing_replay import FETCH_CHUNK, record_dtype

    per_token = shape.num_layers * topk * record_dtype(experts).itemsize
    tp = int(_get(cfg, "parallelism.tensor_model_parallel_size", 1))
    pp = int(_get(cfg, "parallelism.pipeline_model_parallel_size", 1))
    dp = max(1, world // (tp * pp))
    sp = bool(_get(cfg, "parallelism.sequence_parallel", False)) and tp > 1
    step_sequences = int(_get(cfg, "data.train_batch_size")) * int(_get(cfg, "rollout.n"))
    sequences = math.ceil(step_sequences / dp)
    if _get(cfg, "model.moe_routing_replay") == "r3":
        replicas = max(1, world // int(_get(cfg, "rollout.tensor_parallel_size", 1)))
        generated = math.ceil(step_sequences / replicas)
        sequences = max(generated, sequences + min(FETCH_CHUNK, generated))
    length = int(_get(cfg, "data.max_prompt_length")) + int(_get(cfg, "data.max_response_length"))
    tokens = int(_get(cfg, "trainer.max_tokens_per_microbatch")) / (tp if sp else 1)
    return dict(device_bytes=tokens * shape.num_layers * topk * 8,
                host_bytes=sequences * length * per_token, sequences=sequences, tokens_per_sequence=length,
                bytes_per_token=per_token)


def plan(cfg: Any, world: int, gpu_mem_gib: float, *, reserve_gib: float = DEFAULT_RESERVE_GIB,
         shape: Any = None) -> Plan:
    """Validate ``cfg`` for ``world`` ranks and estimate both phases on a ``gpu_mem_gib`` GPU.

    Raises ``config.ConfigError`` when the config is invalid for this world size.
    """
    from mcpo_megatron import config as C

    warnings = C.validate(cfg, world)
    shape = shape if shape is not None else C.model_shape(cfg)
    gpu = gpu_mem_gib * GIB
    separate = _get(cfg, "rollout.placement", "colocated") == "separate"
    train_world, rollout_world = C.role_world_sizes(cfg, world)
    train = estimate_training_memory(shape, cfg, train_world)
    eng = estimate_engine_memory(shape, cfg, rollout_world, gpu)
    reserve = Term("reserve", reserve_gib * GIB, "CUDA context, NCCL buffers, fragmentation (allowance)")
    static = [train[k] for k in ("weights", "grads", "optimizer", "reference") if k in train]
    scores = [train["attention_scores"]] if "attention_scores" in train else []
    training = static + [train["activations"], *scores, train["logits"], train["logprob_chunk"], reserve]
    if not separate:
        training.insert(-1, Term("engine", ENGINE_ASLEEP_GIB * GIB, "engine asleep (weights offloaded, KV freed)"))
    routing = estimate_routing_record(shape, cfg, train_world)
    if routing is not None:
        training.insert(-2, Term(
            "routing", routing["device_bytes"],
            f"model.moe_routing_replay: one micro-batch's int64 expert indices; host record "
            f"{routing['sequences']} sequences x {routing['tokens_per_sequence']} tokens x {shape.num_layers} "
            f"layers x top-{shape.num_experts_per_tok} int16 = {routing['host_bytes'] / GIB:.2f} GiB per rank"))
    share_key = "rollout.dedicated_gpu_memory_utilization" if separate else "rollout.gpu_memory_utilization"
    engine = Term("engine", eng["budget"],
                  f"{share_key}={eng['utilization']:g}: weights {eng['weights'] / GIB:.1f} + "
                  f"allowance {eng['allowance'] / GIB:.1f} + KV cache {max(0.0, eng['kv_cache']) / GIB:.1f} GiB")
    if separate:  # the engine ranks hold the engine and one weight bucket in transit, nothing of training
        bucket = float(_get(cfg, "reshard.bucket_mb", 512)) * 2**20
        rollout = [engine, Term("receive_bucket", bucket, "one reshard bucket received from the trainer (reshard."
                                                          "bucket_mb)"), reserve]
    else:
        rollout = static + [engine, reserve]
    result = Plan(world_size=world, gpu_mem_bytes=gpu, training=training, rollout=rollout, engine=eng,
                  warnings=list(warnings), separate=separate, train_world_size=train_world,
                  rollout_world_size=rollout_world,
                  host_weights_bytes=param_counts(shape, 1, 1)["total"] * 2 if separate else 0.0)
    for phase, terms in (("training", training), ("engine ranks'" if separate else "rollout", rollout)):
        need = Plan.total(terms)
        if need > gpu:
            worst = max((t for t in terms if t.name != "reserve"), key=lambda t: t.bytes)
            fix = f"lower {share_key}" if separate and worst.name == "engine" else _FIXES[worst.name]
            result.errors.append(
                f"{phase} phase needs {need / GIB:.1f} GiB > {gpu_mem_gib:g} GiB per GPU; the largest term "
                f"'{worst.name}' is {worst.gib:.1f} GiB ({worst.note}); to fit, {fix}")
    if eng["kv_cache"] <= 0 or eng["full_length_sequences"] < 1:
        result.errors.append(
            f"kv_cache: {max(0.0, eng['kv_cache']) / GIB:.2f} GiB holds {eng['kv_tokens']:.0f} tokens, less than "
            f"one sequence of {eng['max_sequence_length']} tokens (data.max_prompt_length + "
            f"rollout.max_new_tokens); raise {share_key} or rollout.tensor_parallel_size")
    elif eng["full_length_sequences"] < int(_get(cfg, "rollout.max_num_seqs", 1)):
        result.warnings.append(
            f"kv_cache holds {eng['full_length_sequences']:.0f} full-length sequences per engine replica "
            f"(< rollout.max_num_seqs={_get(cfg, 'rollout.max_num_seqs')}); long rollouts will queue")
    return result


# ------------------------------------------------------------------------------------------------
# Output and command line
# ------------------------------------------------------------------------------------------------

def format_plan(p: Plan, title: str = "") -> str:
    """The plan as a text table (term, GiB, note) per phase, markdown-compatible."""
    lines = []
    if title:
        lines.append(title)
    phases = ((f"training ranks ({p.train_world_size})", p.training), (f"engine ranks ({p.rollout_world_size})",
              p.rollout)) if p.separate else (("training phase", p.training), ("rollout phase", p.rollout))
    for phase, terms in phases:
        lines.append("")
        lines.append(f"| {phase:<14} | {'GiB':>7} | note |")
        lines.append(f"|{'-' * 16}|{'-' * 8}:|------|")
        for t in terms:
            lines.append(f"| {t.name:<14} | {t.gib:7.2f} | {t.note} |")
        total = Plan.total(terms)
        lines.append(f"| {'total':<14} | {total / GIB:7.2f} | of {p.gpu_mem_bytes / GIB:g} GiB "
                     f"({100 * total / p.gpu_mem_bytes:.0f}%) |")
    e = p.engine
    lines.append("")
    lines.append(f"engine (rollout TP={e['rollout_tp']}): KV cache {max(0.0, e['kv_cache']) / GIB:.1f} GiB = "
                 f"{e['kv_tokens'] / 1e3:.0f}k tokens ({e['kv_bytes_per_token'] / 1024:.0f} KiB/token) = "
                 f"{e['full_length_sequences']:.1f} sequences of {e['max_sequence_length']} tokens per replica")
    if p.separate:
        lines.append(f"host: the trainer's first rank keeps the newest weights for the engines, "
                     f"{p.host_weights_bytes / GIB:.1f} GiB (bf16), pinned")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# Separate placement: how many ranks generate
# ------------------------------------------------------------------------------------------------

def step_work(shape: Any, cfg: Any) -> dict[str, float]:
    """Model FLOPs of one global step at full length: generation (every sequence) and training (the old-log-prob
    pass, ``ppo_epochs`` updates, and the reference pass with ``algorithm.kl``)."""
    from mcpo_megatron import accounting

    lengths = dict(prompt_lens=int(_get(cfg, "data.max_prompt_length")),
                   response_lens=int(_get(cfg, "data.max_response_length")),
                   num_sequences=int(_get(cfg, "data.train_batch_size")) * int(_get(cfg, "rollout.n")))
    passes = 2 if _get(cfg, "algorithm.kl.enable", False) else 1
    train = (passes * accounting.model_flops(shape, kind="logprob", **lengths)
             + int(_get(cfg, "algorithm.ppo_epochs", 1)) * accounting.model_flops(shape, kind="train", **lengths))
    return dict(generate_flops=accounting.model_flops(shape, kind="generate", **lengths), train_flops=train)


def suggest_split(cfg: Any, world: int, *, gen_device_s: float, train_device_s: float,
                  gpus_per_node: int | None = None) -> list[dict[str, Any]]:
    """Every valid division of ``world`` ranks into engine and training ranks, fastest first.

    ``gen_device_s`` / ``train_device_s``: device-seconds of one step's generation and training (measured: the
    phase's seconds times the ranks it ran on; or estimated from FLOPs). Both are taken to scale linearly with
    ranks, so with R engine ranks generation takes ``gen_device_s / R`` and training ``train_device_s / (world -
    R)``. A valid split passes ``validate`` (R a multiple of the rollout TP, the rest a multiple of TP x PP and of
    the mini-batch's DP rule). Per split: ranks, nodes (when whole), the phase times, and the step time with
    generation overlapping training (``trainer.max_staleness >= 1``: the longer phase) and without (0: their sum).
    """
    from omegaconf import OmegaConf

    from mcpo_megatron import config as C

    rows = []
    for ranks in range(1, world):
        trial = OmegaConf.merge(C.as_dictconfig(cfg), {"rollout": {"placement": "separate", "ranks": ranks}})
        try:
            C.validate(trial, world)
        except C.ConfigError:
            continue
        gen_s, train_s = gen_device_s / ranks, train_device_s / (world - ranks)
        whole = gpus_per_node and ranks % gpus_per_node == 0
        rows.append(dict(ranks=ranks, nodes=ranks // gpus_per_node if whole else None, generate_s=gen_s,
                         train_s=train_s, overlapped_s=max(gen_s, train_s), sequential_s=gen_s + train_s))
    return sorted(rows, key=lambda r: (r["overlapped_s"], r["ranks"]))


def format_split(rows: list[dict[str, Any]], world: int, source: str, limit: int = 6) -> str:
    if not rows:
        return (f"\nno division of the {world} ranks into engine and training ranks passes the config's rules "
                "(rollout TP, TP x PP, mini-batch per DP rank)")
    lines = ["", f"engine / training ranks ({source}; step with generation overlapping training, "
                 "trainer.max_staleness >= 1, and without):",
             "| engine ranks | nodes | generation s | training s | overlapped s | sequential s |",
             "|---:|---:|---:|---:|---:|---:|"]
    for r in rows[:limit]:
        lines.append(f"| {r['ranks']} | {r['nodes'] if r['nodes'] is not None else '-'} | {r['generate_s']:.0f} | "
                     f"{r['train_s']:.0f} | {r['overlapped_s']:.0f} | {r['sequential_s']:.0f} |")
    best = rows[0]
    whole = [r for r in rows if r["nodes"] is not None]
    lines.append(f"suggested: rollout.ranks={best['ranks']}" + (
        f"; in whole nodes: ROLLOUT_NODES={whole[0]['nodes']} (rollout.ranks={whole[0]['ranks']}, "
        f"{whole[0]['overlapped_s']:.0f} s)" if whole else ""))
    return "\n".join(lines)
