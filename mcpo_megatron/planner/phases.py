"""The two phases of a colocated step on the busiest GPU, and :func:`plan`, which checks them against the device.

* **rollout**: the engine uses ``rollout.gpu_memory_utilization`` of the device
  (:mod:`~mcpo_megatron.planner.engine`) beside what stays of the training state. With ``trainer.offload`` (on
  by default on GPUs with colocated engines) the parts it names are in host memory: the weights, the
  optimizer's fp32 master copy (4 bytes per parameter share of the optimizer term's 12) and Adam's moments (8 of
  12), and the reference are copied to pinned host memory, the gradient buffer is released without a copy. A
  null ``rollout.gpu_memory_utilization`` is then what the phase leaves free: ``(GPU - reserve - what stays) /
  GPU``, rounded down to 0.01; without offload it is 0.6. With offload the plan also shows the rollout phase
  without it (the engine at the largest share that fits beside the whole training state), the pinned host
  memory per node (refused above ``1 - HOST_RESERVE_SHARE`` of the node's RAM) and the seconds to move the
  copies each way at a stated host-device bandwidth per GPU;
* **training**: the training state plus activations at the token budget ``trainer.max_tokens_per_microbatch``,
  the logits of one micro-batch and the vocab-parallel log-prob chunk; the engine sleeps (weights offloaded,
  KV cache freed).

A fixed reserve (CUDA context, NCCL buffers, allocator fragmentation) is added to both. A layout whose phase
total exceeds the device, or whose KV cache cannot hold one sequence of maximum length, is refused (exit 1)
naming the term that overflows and what to change.

The training terms and their formulas are :mod:`~mcpo_megatron.planner.training`'s.

With ``rollout.placement=separate`` the two kinds of rank are planned apart: the training ranks (``world -
rollout.ranks``) hold the training state and activations, never an engine; the engine ranks hold the engine
(``rollout.dedicated_gpu_memory_utilization`` of the device, 0.9 by default: it has the GPU to itself) plus one
reshard bucket received from the trainer; each training rank stages its shards of the newest version in
page-locked host memory, exactly their bytes (the engine replicas' bf16 weights as the reshard plan draws them from
the training ranks: :func:`staged_weights_bytes`, the busiest rank's), and, while the engines take a version,
sends it through one bucket on its GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from mcpo_megatron.accounting import layer_kinds
from mcpo_megatron.planner.common import GIB, cfg_get
from mcpo_megatron.planner.counts import layer_params_split, param_counts
from mcpo_megatron.planner.engine import DEFAULT_UTILIZATION, ENGINE_ASLEEP_GIB, estimate_engine_memory
from mcpo_megatron.planner.training import Term, TrainingLayout, estimate_routing_record, estimate_training_memory

# Fixed allowances (GiB). They are deliberately round numbers: measured values vary by driver, NCCL version
# and fragmentation; raise --reserve-gb on a cluster that needs more.
DEFAULT_RESERVE_GIB = 3.0        # CUDA context + NCCL buffers + allocator fragmentation, per GPU
DEFAULT_HOST_MEM_GIB = 2048.0    # host RAM of a typical 8 x H100 node (DGX H100: 2 TB)
HOST_RESERVE_SHARE = 0.25        # of a node's RAM left to everything but the pinned copies (OS, workers, engines)
DEFAULT_OFFLOAD_GBPS = 25.0      # pinned host <-> GPU per GPU (PCIe Gen5 x16: 64 GB/s peak, shared on a node)


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
    host_weights_bytes: float = 0.0   # separate: a training rank's staged share of the newest weights (pinned host)
    offload: dict[str, Any] | None = None           # trainer.offload's figures (:func:`_offload_figures`)
    rollout_without_offload: list[Term] | None = None  # with offload: the rollout phase had it been off
    engine_without_offload: dict[str, float] | None = None

    @property
    def ok(self) -> bool:
        return not self.errors

    @staticmethod
    def total(terms: list[Term]) -> float:
        return sum(t.bytes for t in terms)


_FIXES = {
    "weights": "raise parallelism.tensor_model_parallel_size or pipeline_model_parallel_size",
    "grads": "raise parallelism.tensor_model_parallel_size or pipeline_model_parallel_size",
    "optimizer": "use more GPUs (a larger DP shards it further; for experts a larger world / (PP x EP x TP)), or "
                 "parallelism.use_distributed_optimizer=true where it is off",
    "activations": "lower trainer.max_tokens_per_microbatch, set model.recompute_activations=true, "
                   "parallelism.sequence_parallel=true, raise TP/PP, or split sequences over "
                   "parallelism.context_parallel_size ranks (with trainer.sequence_packing=true)",
    "attention_scores": "use the Transformer Engine layer spec (transformer-engine installed, model.transformer_impl="
                        "auto: FlashAttention keeps no scores), lower trainer.max_tokens_per_microbatch, or set "
                        "model.recompute_activations=true",
    "logits": "lower trainer.max_tokens_per_microbatch or raise parallelism.tensor_model_parallel_size",
    "logprob_chunk": "lower trainer.logprob_chunk_size",
    "reference": "raise parallelism.tensor_model_parallel_size or pipeline_model_parallel_size (the reference is "
                 "split like the policy), or set algorithm.kl.enable=false",
    "engine": "lower rollout.gpu_memory_utilization (the engine reserves that fraction of the GPU beside what "
              "stays of the training state; with trainer.offload, null is the largest share that fits)",
    "reserve": "use a larger GPU or lower --reserve-gb if the cluster really needs less",
    "routing": "lower trainer.max_tokens_per_microbatch, or set model.moe_routing_replay=off",
}


def plan(cfg: Any, world: int, gpu_mem_gib: float, *, reserve_gib: float = DEFAULT_RESERVE_GIB,
         shape: Any = None, gpus_per_node: int = 8, host_mem_gib: float = DEFAULT_HOST_MEM_GIB,
         offload_gbps: float = DEFAULT_OFFLOAD_GBPS) -> Plan:
    """Validate ``cfg`` for ``world`` ranks and estimate both phases on a ``gpu_mem_gib`` GPU (nodes of
    ``gpus_per_node`` GPUs and ``host_mem_gib`` of RAM; ``offload_gbps``: GB/s between pinned host memory and one
    GPU, for trainer.offload's transfer time).

    Raises ``config.ConfigError`` when the config is invalid for this world size.
    """
    from mcpo_megatron import config as C

    warnings = C.validate(cfg, world)
    shape = shape if shape is not None else C.model_shape(cfg)
    gpu = gpu_mem_gib * GIB
    separate = cfg_get(cfg, "rollout.placement", "colocated") == "separate"
    train_world, rollout_world = C.role_world_sizes(cfg, world)
    train = estimate_training_memory(shape, cfg, train_world)
    reserve = Term("reserve", reserve_gib * GIB, "CUDA context, NCCL buffers, fragmentation (allowance)")
    offload = not separate and C.offload_enabled(cfg, cuda=True)
    kept = _rollout_state(train, cfg, offload)
    share, share_note = (None, "") if separate else colocated_share(cfg, kept, reserve.bytes, gpu, offload)
    eng = estimate_engine_memory(shape, cfg, rollout_world, gpu, utilization=share)
    share_key = "rollout.dedicated_gpu_memory_utilization" if separate else "rollout.gpu_memory_utilization"
    result = Plan(world_size=world, gpu_mem_bytes=gpu,
                  training=_training_table(shape, cfg, train, train_world, reserve, separate=separate),
                  rollout=_rollout_table(cfg, kept, _engine_term(eng, share_key, share_note), reserve,
                                         separate=separate),
                  engine=eng, warnings=list(warnings), separate=separate, train_world_size=train_world,
                  rollout_world_size=rollout_world,
                  host_weights_bytes=staged_weights_bytes(shape, cfg, train_world, rollout_world) if separate
                  else 0.0)
    if offload:
        _add_offload(result, shape, cfg, train, reserve, gpus_per_node, host_mem_gib, offload_gbps)
    if cfg_get(cfg, "rollout.engine", "vllm") == "torch":
        whole = param_counts(shape, 1, 1)["total"] * (4 if cfg_get(cfg, "model.dtype", "auto") == "fp32" else 2)
        result.warnings.append(
            f"rollout.engine=torch: the engine rows plan vLLM's engine (rollout TP, sleep mode, paged KV cache); the "
            f"PyTorch engine holds the whole model on every rank ({whole / GIB:.1f} GiB) beside the training state, "
            "and a cache per row of its batch")
    _refuse_what_does_not_fit(result, gpu_mem_gib, share_key)
    _check_kv_cache(result, cfg, share_key)
    return result


def _offload_parts(cfg: Any) -> dict[str, bool]:
    from mcpo_megatron.config.sections.training import OFFLOAD_PARTS

    return {k: bool(cfg_get(cfg, f"trainer.offload.{k}", True)) for k in OFFLOAD_PARTS}


def _rollout_state(train: dict[str, Term], cfg: Any, offload: bool) -> list[Term]:
    """What the rollout phase holds of the training state: all of it, or with trainer.offload each term less the
    parts in host memory (a 0 GiB row says where it went)."""
    if not offload:
        return _static_terms(train)
    parts = _offload_parts(cfg)
    out = []
    for term in _static_terms(train):
        gone = _offloaded_bytes(term, parts)
        if gone <= 0:
            out.append(term)
            continue
        how = "released, zeroed when back" if term.name == "grads" else "copied to pinned host memory"
        note = f"trainer.offload: {gone / GIB:.2f} GiB {how}"
        if term.bytes - gone > 0:
            note += f"; {(term.bytes - gone) / GIB:.2f} GiB stay ({term.note})"
        out.append(Term(term.name, term.bytes - gone, note))
    return out


def _offloaded_bytes(term: Term, parts: dict[str, bool]) -> float:
    """The bytes of ``term`` that trainer.offload moves off the GPU. The optimizer term is the fp32 master
    copy (4 bytes per parameter, bf16 models only) and Adam's two moments (4 + 4)."""
    if term.name in ("weights", "grads"):
        return term.bytes if parts["buffers"] else 0.0
    if term.name == "reference":
        return term.bytes if parts["reference"] else 0.0
    if term.name == "optimizer":
        has_master = term.note.startswith("fp32 master")  # bf16 weights (_optimizer_term)
        master, moments = (4 / 12, 8 / 12) if has_master else (0.0, 1.0)
        return term.bytes * (master * parts["master_weights"] + moments * parts["moments"])
    return 0.0


def colocated_share(cfg: Any, kept: list[Term], reserve_bytes: float, gpu_bytes: float,
                    offload: bool) -> tuple[float, str]:
    """(share of the GPU, note) of a colocated engine: ``rollout.gpu_memory_utilization`` when set; null: with
    trainer.offload what the rollout phase leaves beside ``kept`` (what stays of the training state) and the
    reserve, rounded down to 0.01; without it 0.6."""
    configured = cfg_get(cfg, "rollout.gpu_memory_utilization", None)
    if configured is not None:
        return float(configured), ""
    if not offload:
        return DEFAULT_UTILIZATION, " (null: the default beside the resident training state)"
    free = (gpu_bytes - reserve_bytes - Plan.total(kept)) / gpu_bytes
    return max(0.01, math.floor(free * 100) / 100), " (null: what trainer.offload leaves free)"


def colocated_engine_share(cfg: Any, world: int, gpu_mem_bytes: float, *, cuda: bool = True,
                           reserve_gib: float = DEFAULT_RESERVE_GIB, shape: Any = None) -> float:
    """The share of a ``gpu_mem_bytes`` GPU a colocated engine takes in a run of ``world`` ranks, as :func:`plan`
    resolves it (:func:`colocated_share`); the trainer's, for a null ``rollout.gpu_memory_utilization``."""
    from mcpo_megatron import config as C

    shape = shape if shape is not None else C.model_shape(cfg)
    train = estimate_training_memory(shape, cfg, C.role_world_sizes(cfg, world)[0])
    offload = C.offload_enabled(cfg, cuda=cuda)
    return colocated_share(cfg, _rollout_state(train, cfg, offload), reserve_gib * GIB, gpu_mem_bytes, offload)[0]


def _largest_share(kept: list[Term], reserve_bytes: float, gpu_bytes: float) -> float:
    return max(0.01, math.floor((gpu_bytes - reserve_bytes - Plan.total(kept)) / gpu_bytes * 100) / 100)


def _add_offload(result: Plan, shape: Any, cfg: Any, train: dict[str, Term], reserve: Term, gpus_per_node: int,
                 host_mem_gib: float, offload_gbps: float) -> None:
    """trainer.offload's figures, the rollout phase without it, and a refusal when the node's RAM cannot hold the
    pinned copies."""
    parts = _offload_parts(cfg)
    moved = {t.name: _offloaded_bytes(t, parts) for t in _static_terms(train)}
    copied = sum(v for k, v in moved.items() if k != "grads")
    per_node = copied * gpus_per_node
    host = host_mem_gib * GIB
    result.offload = dict(moved=moved, copied_bytes=copied, released_bytes=moved.get("grads", 0.0),
                          host_per_node_bytes=per_node, host_mem_bytes=host, gpus_per_node=gpus_per_node,
                          gbps=offload_gbps, seconds=copied / (offload_gbps * 1e9))
    whole = _static_terms(train)
    share = _largest_share(whole, reserve.bytes, result.gpu_mem_bytes)
    eng = estimate_engine_memory(shape, cfg, result.rollout_world_size, result.gpu_mem_bytes, utilization=share)
    result.engine_without_offload = eng
    result.rollout_without_offload = whole + [
        _engine_term(eng, "rollout.gpu_memory_utilization", " (the largest share that fits beside the training "
                                                            "state)"), reserve]
    if per_node > (1 - HOST_RESERVE_SHARE) * host:
        result.errors.append(
            f"host memory: trainer.offload pins {copied / GIB:.1f} GiB per GPU, {per_node / GIB:.0f} GiB per node "
            f"of {gpus_per_node} GPUs, more than {1 - HOST_RESERVE_SHARE:g} of the node's {host_mem_gib:g} GiB "
            "(--host-mem-gb); set trainer.offload.master_weights=false or moments=false (they stay on the GPU), "
            "use more GPUs (the optimizer shard shrinks with DP), or trainer.offload.enable=false")


def _static_terms(train: dict[str, Term]) -> list[Term]:
    """What stays resident in both phases: the training state and the reference."""
    return [train[k] for k in ("weights", "grads", "optimizer", "reference") if k in train]


def staged_weights_bytes(shape: Any, cfg: Any, train_world: int, rollout_world: int) -> float:
    """Separate placement: the page-locked host memory the busiest training rank stages each version in, exactly
    as allocated (``rollout/separate/plan.StagedShards``, registered at its size: ``parallel/pinned.py``), in bf16.

    A rank stages its shard of what the engine replicas draw from it. The reshard plan draws engine replica r's
    layer l from the trainer's data-parallel replica (r + l + 1) mod DP (expert layers: over the expert
    data-parallel replicas), and its tensors outside the layers (embedding, output layer, final norm) from
    replica r mod DP, each from the pipeline stage holding it and context-parallel rank 0
    (``rollout/weights/plan.choose_source``). So a rank of stage p stages its TP shard of p's layers once per
    (replica, layer) pair its replica is drawn for, and p's other tensors once per replica drawing them from it:
    the largest such sum over stages and replicas, counting replicated norms on every TP rank and megatron's
    padded query groups (a small overcount)."""
    lay = TrainingLayout.from_config(cfg, train_world)
    replicas = max(1, rollout_world // int(cfg_get(cfg, "rollout.tensor_parallel_size", 1)))
    kinds = layer_kinds(shape)
    split = {kind: layer_params_split(shape, lay.tp, lay.ep, kind) for kind in set(kinds)}  # (dense, expert)
    h, v = shape.hidden_size, shape.vocab_size
    embedding = v * h // lay.tp
    output = 0 if shape.tie_word_embeddings else v * h // lay.tp  # tied: the engines take the embedding once
    chunk = -(-shape.num_layers // (lay.pp * lay.vpp))  # megatron's (virtual) stages of consecutive layers
    busiest = 0
    for stage in range(lay.pp):
        layers = [layer for layer in range(shape.num_layers) if (layer // chunk) % lay.pp == stage]
        outside = (embedding if stage == 0 else 0) + (output + h if stage == lay.pp - 1 else 0)
        per_replica = [outside * m for m in _draws(replicas, lay.dp, [-1])]
        experts = [0] * lay.edp
        for kind, (dense, expert) in split.items():   # a hybrid decoder's layers of each kind
            mine = [layer for layer in layers if kinds[layer] == kind]
            per_replica = [x + dense * n for x, n in zip(per_replica, _draws(replicas, lay.dp, mine))]
            experts = [x + expert * n for x, n in zip(experts, _draws(replicas, lay.edp, mine))]
        busiest = max(busiest, max(per_replica) + max(experts))
    return 2.0 * busiest


def _draws(replicas: int, dp: int, layers: list[int]) -> list[int]:
    """Per data-parallel replica of the trainer (of ``dp``), the (engine replica, layer) pairs drawn from it:
    replica r's layer l from (r + l + 1) mod dp (l = -1: the tensors outside the layers)."""
    counts = [0] * dp
    for r in range(replicas):
        for layer in layers:
            counts[(r + layer + 1) % dp] += 1
    return counts


def _training_table(shape: Any, cfg: Any, train: dict[str, Term], train_world: int, reserve: Term, *,
                    separate: bool) -> list[Term]:
    """The training phase's rows: the training state, the step's working memory, a sleeping colocated engine,
    routing replay's record, the reserve."""
    scores = [train["attention_scores"]] if "attention_scores" in train else []
    training = _static_terms(train) + [train["activations"], *scores, train["logits"], train["logprob_chunk"],
                                       reserve]
    if not separate:
        training.insert(-1, Term("engine", ENGINE_ASLEEP_GIB * GIB, "engine asleep (weights offloaded, KV freed)"))
    else:  # the engines take a version while the trainer trains
        bucket = float(cfg_get(cfg, "reshard.bucket_mb", 512)) * 2**20
        training.insert(-1, Term("send_bucket", bucket, "one round of the staged weights on its way to the engine "
                                                        "ranks (reshard.bucket_mb)"))
    routing = estimate_routing_record(shape, cfg, train_world)
    if routing is not None:
        training.insert(-2, Term(
            "routing", routing["device_bytes"],
            f"model.moe_routing_replay: one micro-batch's int64 expert indices; host record "
            f"{routing['sequences']} sequences x {routing['tokens_per_sequence']} tokens x {shape.num_layers} "
            f"layers x top-{shape.num_experts_per_tok} int16 = {routing['host_bytes'] / GIB:.2f} GiB per rank"))
    return training


def _engine_term(eng: dict[str, float], share_key: str, share_note: str = "") -> Term:
    return Term("engine", eng["budget"],
                f"{share_key}={eng['utilization']:g}{share_note}: weights {eng['weights'] / GIB:.1f} + "
                f"allowance {eng['allowance'] / GIB:.1f} + KV cache {max(0.0, eng['kv_cache']) / GIB:.1f} GiB")


def _rollout_table(cfg: Any, kept: list[Term], engine: Term, reserve: Term, *, separate: bool) -> list[Term]:
    """The rollout phase's rows (colocated: what stays of the training state beside the engine), or the engine
    ranks'."""
    if separate:  # the engine ranks hold the engine and one weight bucket in transit, nothing of training
        bucket = float(cfg_get(cfg, "reshard.bucket_mb", 512)) * 2**20
        return [engine, Term("receive_bucket", bucket, "one reshard bucket received from the trainer (reshard."
                                                       "bucket_mb)"), reserve]
    return kept + [engine, reserve]


def _refuse_what_does_not_fit(result: Plan, gpu_mem_gib: float, share_key: str) -> None:
    """An error per phase whose total exceeds the device, naming its largest term and the fix."""
    phases = (("training", result.training), ("engine ranks'" if result.separate else "rollout", result.rollout))
    for phase, terms in phases:
        need = Plan.total(terms)
        if need > result.gpu_mem_bytes:
            worst = max((t for t in terms if t.name != "reserve"), key=lambda t: t.bytes)
            fix = f"lower {share_key}" if result.separate and worst.name == "engine" else _FIXES[worst.name]
            result.errors.append(
                f"{phase} phase needs {need / GIB:.1f} GiB > {gpu_mem_gib:g} GiB per GPU; the largest term "
                f"'{worst.name}' is {worst.gib:.1f} GiB ({worst.note}); to fit, {fix}")


def _check_kv_cache(result: Plan, cfg: Any, share_key: str) -> None:
    """An error when the engine's KV cache cannot hold one full-length sequence, a warning when it holds fewer
    than ``rollout.max_num_seqs``."""
    eng = result.engine
    if eng["kv_cache"] <= 0 or eng["full_length_sequences"] < 1:
        result.errors.append(
            f"kv_cache: {max(0.0, eng['kv_cache']) / GIB:.2f} GiB holds {eng['kv_tokens']:.0f} tokens, less than "
            f"one sequence of {eng['max_sequence_length']} tokens (data.max_prompt_length + "
            f"rollout.max_new_tokens); raise {share_key} or rollout.tensor_parallel_size")
    elif eng["full_length_sequences"] < int(cfg_get(cfg, "rollout.max_num_seqs", 1)):
        result.warnings.append(
            f"kv_cache holds {eng['full_length_sequences']:.0f} full-length sequences per engine replica "
            f"(< rollout.max_num_seqs={cfg_get(cfg, 'rollout.max_num_seqs')}); long rollouts will queue")
