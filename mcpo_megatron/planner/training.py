"""The training phase's memory on the busiest GPU, term by term (:func:`estimate_training_memory`), and MoE routing
replay's record (:func:`estimate_routing_record`); :mod:`~mcpo_megatron.planner.phases` sets them beside the
engine and the reserve.

The training terms (bytes; P = parameters of the busiest stage on one rank, :mod:`~mcpo_megatron.planner.counts`):

* weights ``2 P`` (bf16; 4 with ``model.dtype=fp32``), gradients ``4 P`` (megatron DDP with
  ``grad_reduce_in_fp32``), optimizer ``(4 + 4 + 4) P / DP`` (fp32 master copy + Adam m and v, sharded over DP
  by the distributed optimizer; the master copy is omitted for fp32 weights; not divided without the
  distributed optimizer); expert parameters are sharded over the expert-data-parallel size
  ``world / (PP * ep * t)`` instead of DP;
* with ``algorithm.kl.enable`` the frozen reference policy: another ``2 P`` (weights only, same layout), resident
  in both phases;
* activations: the first stage holds ``p`` micro-batches in flight under 1F1B, each of ``ceil(L/p)`` layers; with
  ``v`` virtual stages ``ceil(p * (1 + (p - 1) / (p * v)))`` (Narayanan et al. 2021, interleaved 1F1B; the
  estimate of Megatron-LM's ``theoretical_memory_usage``). With ``model.recompute_activations`` (full, uniform, 1
  layer) only each layer's input (``2h`` per token, ``/t`` with sequence parallelism) is kept, plus one layer's
  activations while it is recomputed; a hybrid decoder's stage sums its layers by kind (the busiest stage's mix);
* attention scores, with ``model.transformer_impl=local`` only (megatron's unfused attention: what runs on GPUs
  without Transformer Engine, and on CPUs), for sequences of at most ``data.max_prompt_length +
  data.max_response_length`` tokens and the same layers and micro-batches in flight as the activations (one
  layer with recomputation; a hybrid decoder's full-attention layers only); ``auto`` is planned as the Transformer
  Engine spec (FlashAttention), what GPU clusters install;
* logits of one micro-batch's response positions on the last stage (at most ``T``, the budget; prompts are
  rarely a large share of an RL micro-batch, so the bound is kept): ``T * V/t * 2`` bytes, twice (value and
  gradient);
* activation and logit bytes double with ``model.dtype=fp32`` (``auto`` is planned as bf16: the GPU case);
* log-prob chunk: ``chunk * V/t * 4`` bytes x 3 fp32 copies (upcast logits, exp, gradient).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from mcpo_megatron.accounting import layer_kinds
from mcpo_megatron.planner.common import GIB, cfg_get
from mcpo_megatron.planner.counts import (activation_bytes_per_token_layer, attention_score_bytes, moe_sizes,
                                          param_counts, stage_layers)


@dataclass(frozen=True)
class Term:
    """One line of the memory table."""

    name: str
    bytes: float
    note: str

    @property
    def gib(self) -> float:
        return self.bytes / GIB


@dataclass(frozen=True)
class TrainingLayout:
    """What the training-phase estimate reads from a config, for ``world`` training ranks."""

    tp: int
    pp: int
    ep: int
    vpp: int
    cp: int                  # context parallel: a micro-batch's tokens split over CP ranks
    dp: int
    edp: int                 # expert data parallel (expert-TP = TP)
    sequence_parallel: bool
    distributed_optimizer: bool
    recompute: bool
    reference: bool          # algorithm.kl's frozen reference policy
    tokens: int              # trainer.max_tokens_per_microbatch
    logprob_chunk: int
    unfused_attention: bool  # model.transformer_impl=local
    longest: int             # data.max_prompt_length + data.max_response_length
    dtype_bytes: int         # 4 with model.dtype=fp32, else 2

    @classmethod
    def from_config(cls, cfg: Any, world: int) -> "TrainingLayout":
        tp = int(cfg_get(cfg, "parallelism.tensor_model_parallel_size", 1))
        pp = int(cfg_get(cfg, "parallelism.pipeline_model_parallel_size", 1))
        ep = int(cfg_get(cfg, "parallelism.expert_model_parallel_size", 1))
        cp = int(cfg_get(cfg, "parallelism.context_parallel_size", 1))
        return cls(
            tp=tp, pp=pp, ep=ep, cp=cp,
            vpp=int(cfg_get(cfg, "parallelism.virtual_pipeline_model_parallel_size", 1) or 1),
            dp=max(1, world // (tp * pp * cp)),
            edp=max(1, world // (tp * pp * ep)),
            sequence_parallel=bool(cfg_get(cfg, "parallelism.sequence_parallel", False)) and tp > 1,
            distributed_optimizer=bool(cfg_get(cfg, "parallelism.use_distributed_optimizer", True)),
            recompute=bool(cfg_get(cfg, "model.recompute_activations", False)),
            reference=bool(cfg_get(cfg, "algorithm.kl.enable", False)),
            tokens=-(-int(cfg_get(cfg, "trainer.max_tokens_per_microbatch")) // cp),  # this CP rank's share
            logprob_chunk=int(cfg_get(cfg, "trainer.logprob_chunk_size")),
            unfused_attention=str(cfg_get(cfg, "model.transformer_impl", "auto")) == "local",
            longest=int(cfg_get(cfg, "data.max_prompt_length", 0)) + int(cfg_get(cfg, "data.max_response_length", 0)),
            dtype_bytes=4 if str(cfg_get(cfg, "model.dtype", "auto")) == "fp32" else 2,
        )


def estimate_training_memory(shape: Any, cfg: Any, world: int) -> dict[str, Term]:
    """Per-GPU training-phase terms of the busiest pipeline stage (see the module docstring for formulas).

    Keys: weights, grads, optimizer, activations, logits, logprob_chunk, with ``algorithm.kl.enable``
    reference (the frozen reference policy's weights, split like the policy's), and with
    ``model.transformer_impl=local`` attention_scores (the unfused attention's softmax probabilities).
    """
    lay = TrainingLayout.from_config(cfg, world)
    counts = param_counts(shape, lay.tp, lay.pp, lay.ep)
    pp, vpp = lay.pp, lay.vpp
    in_flight = pp if vpp == 1 else math.ceil(pp * (1 + (pp - 1) / (pp * vpp)))
    first = _stage_terms(shape, lay, counts, counts["first"], in_flight, has_logits=(pp == 1))
    if pp == 1:
        return first
    last = _stage_terms(shape, lay, counts, counts["last"], 1, has_logits=True)
    return first if sum(t.bytes for t in first.values()) >= sum(t.bytes for t in last.values()) else last


def _stage_terms(shape: Any, lay: TrainingLayout, counts: dict[str, int], params: int, in_flight: int,
                 has_logits: bool) -> dict[str, Term]:
    """The training terms of one pipeline stage holding ``params`` parameters per rank and ``in_flight``
    micro-batches, with the logits when it is the last stage."""
    wbytes, tp, v = lay.dtype_bytes, lay.tp, shape.vocab_size
    dtype_name = "fp32" if wbytes == 4 else "bf16"
    expert = counts["expert_stage"]
    moe_note = (f", experts {expert / 1e9:.2f}B/GPU (EP={lay.ep})" if expert else "")
    terms = {
        "weights": Term("weights", params * wbytes,
                        f"{params / 1e9:.2f}B params/GPU ({dtype_name}, TP={tp}, PP={lay.pp}{moe_note})"),
        "grads": Term("grads", params * 4, "fp32 main-grad buffer (grad_reduce_in_fp32)"),
        "optimizer": _optimizer_term(lay, params, expert),
        "activations": _activation_term(shape, lay, counts["layers_per_stage"], in_flight),
        "logits": Term("logits", lay.tokens * v / tp * wbytes * 2 if has_logits else 0,
                       f"{lay.tokens} x {v // tp} {dtype_name}, value + gradient" if has_logits
                       else "not on this stage"),
        "logprob_chunk": Term("logprob_chunk", lay.logprob_chunk * v / tp * 4 * 3 if has_logits else 0,
                              f"{lay.logprob_chunk} x {v // tp} fp32 x 3" if has_logits else "not on this stage"),
    }
    if lay.unfused_attention:
        terms["attention_scores"] = _attention_scores_term(shape, lay, counts["full_attention_per_stage"], in_flight)
    if lay.reference:
        terms["reference"] = Term("reference", params * wbytes,
                                  "algorithm.kl: frozen reference policy, weights only, split like the policy")
    return terms


def _optimizer_term(lay: TrainingLayout, params: int, expert: int) -> Term:
    """fp32 master weights (bf16 models) and Adam's moments, sharded by the distributed optimizer: dense
    parameters over DP, expert parameters over expert-DP."""
    opt_per_param = (8 if lay.dtype_bytes == 4 else 12)
    # megatron's distributed optimizer shards dense parameters over data x context parallel ranks
    dense_div, expert_div = (lay.dp * lay.cp, lay.edp) if lay.distributed_optimizer else (1, 1)
    opt_bytes = (params - expert) * opt_per_param / dense_div + expert * opt_per_param / expert_div
    return Term("optimizer", opt_bytes,
                ("fp32 master + " if lay.dtype_bytes == 2 else "") + "Adam m, v"
                + (f" sharded over DP={lay.dp}" + (f" x CP={lay.cp}" if lay.cp > 1 else "")
                   if lay.distributed_optimizer else " (not sharded)")
                + (f", experts over expert-DP={lay.edp}" if lay.distributed_optimizer and expert else ""))


def _activation_term(shape: Any, lay: TrainingLayout, layers: int, in_flight: int) -> Term:
    """What the stage's layers keep for backward over the micro-batches in flight (or, with recomputation, their
    inputs and one recomputed layer)."""
    tokens, sp = lay.tokens, lay.sequence_parallel
    # per kind of layer (a hybrid decoder's stages mix Gated DeltaNet and full-attention layers)
    per_kind = {kind: activation_bytes_per_token_layer(shape, lay.tp, sp, lay.dtype_bytes, kind)
                for kind in set(layer_kinds(shape))}
    stage = max((sum(per_kind[layer_kinds(shape)[i]] for i in idx) for idx in stage_layers(shape, lay.pp)),
                default=0.0) if len(per_kind) > 1 else layers * next(iter(per_kind.values()))
    per_layer = stage / layers
    if lay.recompute:
        kept = lay.dtype_bytes * shape.hidden_size / (lay.tp if sp else 1)
        act = tokens * (in_flight * layers * kept + max(per_kind.values()))
        note = (f"recompute: {layers} layer inputs x {in_flight} micro-batch(es) in flight + 1 layer recomputed, "
                f"{tokens} tokens")
    else:
        act = tokens * in_flight * stage
        note = (f"{per_layer / 1024:.1f} KiB/token/layer{' (mean of its kinds)' if len(per_kind) > 1 else ''} x "
                f"{layers} layers x {in_flight} in flight x {tokens} tokens")
    return Term("activations", act, note + (", sequence parallel" if sp else ""))


def _attention_scores_term(shape: Any, lay: TrainingLayout, layers: int, in_flight: int) -> Term:
    """The unfused attention's softmax probabilities (``model.transformer_impl=local``)."""
    pairs = attention_score_bytes(shape, lay.tp, lay.tokens, lay.longest or lay.tokens, lay.dtype_bytes)
    kept = 1 if lay.recompute else in_flight * layers   # layers: the stage's full-attention layers
    return Term("attention_scores", pairs * kept,
                f"model.transformer_impl=local: unfused softmax probabilities, {pairs / GIB:.2f} GiB/layer x "
                + ("1 recomputed layer" if lay.recompute else f"{layers} layers x {in_flight} in flight"))


def estimate_routing_record(shape: Any, cfg: Any, world: int) -> dict[str, float] | None:
    """MoE routing replay's record (``model.moe_routing_replay`` r2 / r3; None when off or dense): int16 expert
    indices, tokens x MoE layers x top-k, in host memory at full length: R2 for this DP rank's sequences; R3 the
    larger of the sequences this rank's rollout replica generated and its DP share plus one transfer chunk
    (the trainer's fetch_routing; with dynamic sampling a replica holds the routing of every generation
    batch until the step's groups are chosen).  On the GPU: one micro-batch's int64 indices
    (``trainer.max_tokens_per_microbatch`` tokens, this TP rank's slice with sequence parallelism) for every layer.
    Keys: device_bytes, host_bytes, sequences (per rank), tokens_per_sequence, bytes_per_token (host)."""
    experts, topk, _ = moe_sizes(shape)
    if not experts or str(cfg_get(cfg, "model.moe_routing_replay", "off")) == "off":
        return None
    from mcpo_megatron.models.routing_replay import FETCH_CHUNK, record_dtype

    per_token = shape.num_layers * topk * record_dtype(experts).itemsize
    tp = int(cfg_get(cfg, "parallelism.tensor_model_parallel_size", 1))
    pp = int(cfg_get(cfg, "parallelism.pipeline_model_parallel_size", 1))
    dp = max(1, world // (tp * pp))
    sp = bool(cfg_get(cfg, "parallelism.sequence_parallel", False)) and tp > 1
    step_sequences = int(cfg_get(cfg, "data.train_batch_size")) * int(cfg_get(cfg, "rollout.n"))
    sequences = math.ceil(step_sequences / dp)
    if cfg_get(cfg, "model.moe_routing_replay") == "r3":
        replicas = max(1, world // int(cfg_get(cfg, "rollout.tensor_parallel_size", 1)))
        generated = math.ceil(step_sequences / replicas)
        sequences = max(generated, sequences + min(FETCH_CHUNK, generated))
    length = int(cfg_get(cfg, "data.max_prompt_length")) + int(cfg_get(cfg, "data.max_response_length"))
    tokens = int(cfg_get(cfg, "trainer.max_tokens_per_microbatch")) / (tp if sp else 1)
    return dict(device_bytes=tokens * shape.num_layers * topk * 8,
                host_bytes=sequences * length * per_token, sequences=sequences, tokens_per_sequence=length,
                bytes_per_token=per_token)
