"""Weight resharding: the trainer's Megatron shards -> the rollout engine, streamed in buckets.

Two plans, chosen per push:

* **gather** (default; always for the CPU engine): the models package's
  :func:`~mcpo_megatron.models.hf_io.iter_hf_tensors` yields each full
  Hugging Face tensor on every rank (TP shards gathered, pipeline stages
  exchanging their layers, fused QKV / gate-up split into HF tensors); the
  engine slices what it needs (vLLM's loaders cut each rank's TP shard
  themselves, for any rollout TP).
* **pass-through** (rollout TP == training TP and ``engine.accepts_tp_shards``):
  no TP gather.  For each parameter the owning pipeline stage broadcasts its
  Megatron shard to the other stages of its pipeline group (the only exchange),
  and every rank converts its own shard into HF-named *local* shards with
  :func:`megatron_shard_to_hf_local` (q/k/v rows of this rank's query groups,
  gate/up halves, vocab rows, row-parallel columns).  Models with TP-padded
  query groups, mixture-of-experts models (the engine's expert layout is its own:
  vLLM places experts by its TP/EP, not by ours) and virtual pipelines (several
  chunks per rank) fall back to gather.

Gather-mode tensors are fresh copies; pass-through tensors on the owning stage
may alias live parameters, so an engine must copy what it receives before
``update_weights`` returns (every engine here does).

Tensors are grouped into buckets of at most ``bucket_mb`` MiB (a tensor larger
than that travels alone).  The generator drops its references to a bucket as
soon as the engine has consumed it, so the extra memory of a push is about one
bucket plus the tensor being produced.  :meth:`Resharder.push` returns and logs
the seconds, bytes and GB/s of the update.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch

log = logging.getLogger(__name__)

NamedTensor = tuple[str, torch.Tensor]


@dataclass
class ReshardStats:
    """One weight update: wall seconds, bytes delivered to the engine, GB/s (1e9 B/s),
    number of buckets, the largest bucket's bytes, tensors sent, and the plan used."""

    seconds: float
    bytes: int
    gbps: float
    buckets: int
    max_bucket_bytes: int
    tensors: int
    mode: str

    def __str__(self) -> str:
        return (f"reshard[{self.mode}]: {self.bytes / 1e9:.3f} GB in {self.seconds:.3f} s = {self.gbps:.2f} GB/s, "
                f"{self.tensors} tensors in {self.buckets} buckets (largest {self.max_bucket_bytes / 2**20:.1f} MiB)")


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def bucketize(named: Iterable[NamedTensor], bucket_bytes: int) -> Iterator[list[NamedTensor]]:
    """Group a stream of tensors into lists of at most ``bucket_bytes`` (an oversized
    tensor forms its own bucket), preserving order."""
    if bucket_bytes < 1:
        raise ValueError(f"reshard.bucket_mb must be positive (got {bucket_bytes} bytes)")
    bucket: list[NamedTensor] = []
    size = 0
    for name, t in named:
        nb = tensor_bytes(t)
        if bucket and size + nb > bucket_bytes:
            out, bucket, size = bucket, [], 0
            yield out
            del out
        bucket.append((name, t))
        size += nb
        del t
    if bucket:
        yield bucket


def megatron_shard_to_hf_local(rule, shard: torch.Tensor, shape) -> list[NamedTensor]:
    """This TP rank's Megatron shard of ``rule`` -> HF-named tensors holding only this rank's part.

    The HF tensor of rank r is the r-th block of the full HF tensor along its TP
    dimension (rows for q/k/v, gate/up and vocab; columns for o_proj/down_proj;
    the whole tensor for norms), i.e. what a TP engine with the same TP size holds.
    """
    kind = rule.kind
    if kind in ("copy", "vocab", "row", "proj"):
        return [(rule.hf[0], shard)]
    if kind == "gate_up":
        gate, up = shard.chunk(2, dim=0)
        return [(rule.hf[0], gate), (rule.hf[1], up)]
    if kind == "qkv":
        hd, hpg = shape.head_dim, shape.heads_per_group
        groups = shape.num_query_groups // shape.tp
        tail = tuple(shard.shape[1:])
        grouped = shard.reshape(groups, (hpg + 2) * hd, *tail)
        q, k, v = torch.split(grouped, [hpg * hd, hd, hd], dim=1)
        return [(rule.hf[0], q.reshape(groups * hpg * hd, *tail)),
                (rule.hf[1], k.reshape(groups * hd, *tail)),
                (rule.hf[2], v.reshape(groups * hd, *tail))]
    raise ValueError(f"unknown rule kind {kind!r}")


class Resharder:
    """Streams the policy's weights into a rollout engine.

    Args:
        model_chunks: this rank's bare ``GPTModel`` chunks (``MegatronPolicy.model_chunks``).
        hf_config: the Hugging Face config of the model.
        bucket_mb: bucket size in MiB (``reshard.bucket_mb``).
        rollout_tp: the engine's tensor-parallel size (``rollout.tensor_parallel_size``).
        parallel_info: this rank's :class:`~mcpo_megatron.parallel.distributed.ParallelInfo`
            (needed for pass-through and logging; default from ``parallel_state``).
        dtype: cast tensors to this dtype for the engine (e.g. bf16 for vLLM); None keeps it.
    """

    def __init__(self, model_chunks, hf_config, *, bucket_mb: float = 512, rollout_tp: int = 1,
                 parallel_info=None, dtype: torch.dtype | None = None):
        if not bucket_mb > 0:
            raise ValueError(f"reshard.bucket_mb={bucket_mb!r} must be > 0 (MiB per bucket)")
        if rollout_tp < 1:
            raise ValueError(f"rollout.tensor_parallel_size={rollout_tp!r} must be >= 1")
        self.model_chunks = list(model_chunks)
        self.hf_config = hf_config
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.rollout_tp = int(rollout_tp)
        self.dtype = dtype
        if parallel_info is None and torch.distributed.is_initialized():
            from mcpo_megatron.parallel.distributed import parallel_info as _pi

            parallel_info = _pi()
        self.info = parallel_info

    # ------------------------------------------------------------------ plans
    @property
    def train_tp(self) -> int:
        return 1 if self.info is None else int(self.info.tp)

    def can_pass_through(self, engine=None) -> bool:
        """True when the pass-through plan applies (see the module docstring)."""
        if engine is not None and not getattr(engine, "accepts_tp_shards", False):
            return False
        if self.rollout_tp != self.train_tp or self.train_tp == 1:
            return False
        from mcpo_megatron.models.builder import unwrap

        if len(self.model_chunks) != 1:
            return False
        shape = unwrap(self.model_chunks[0]).mcpo_shape
        return shape.padded_groups == 0 and not shape.is_moe

    def iter_tensors(self, pass_through: bool = False) -> Iterator[NamedTensor]:
        """The ``(hf_name, tensor)`` stream of one update (full tensors, or local shards)."""
        if pass_through:
            return self._iter_local_shards()
        from mcpo_megatron.models.hf_io import iter_hf_tensors

        return iter_hf_tensors(self.model_chunks, self.hf_config, dtype=self.dtype)

    def iter_buckets(self, pass_through: bool = False) -> Iterator[list[NamedTensor]]:
        """Buckets of at most ``bucket_mb`` MiB; a larger single tensor travels alone."""
        return bucketize(self.iter_tensors(pass_through), self.bucket_bytes)

    # ------------------------------------------------------------------ push
    def push(self, engine, *, pass_through: bool | None = None) -> ReshardStats:
        """Stream every weight into ``engine.update_weights`` bucket by bucket, between the engine's
        ``begin_update`` and ``finish_update`` (when it has them); return the stats.

        ``pass_through=None`` chooses the pass-through plan when :meth:`can_pass_through`.
        """
        if pass_through is None:
            pass_through = self.can_pass_through(engine)
        elif pass_through and not self.can_pass_through(engine):
            raise ValueError(
                f"pass-through resharding needs rollout TP ({self.rollout_tp}) == training TP "
                f"({self.train_tp}) > 1, an engine with accepts_tp_shards=True, no TP-padded query groups, "
                "no experts and no virtual pipeline"
            )
        sync = _device_sync(self.info)
        sync()
        start = time.perf_counter()
        total = n_buckets = n_tensors = largest = 0
        begin = getattr(engine, "begin_update", None)
        if begin is not None:
            begin()
        for bucket in self.iter_buckets(pass_through):
            size = sum(tensor_bytes(t) for _, t in bucket)
            engine.update_weights(bucket)
            total += size
            n_buckets += 1
            n_tensors += len(bucket)
            largest = max(largest, size)
            del bucket  # the engine copied it; let it go before the next one is built
        finish = getattr(engine, "finish_update", None)
        if finish is not None:
            finish()
        sync()
        seconds = time.perf_counter() - start
        stats = ReshardStats(seconds=seconds, bytes=total, gbps=total / max(seconds, 1e-12) / 1e9,
                             buckets=n_buckets, max_bucket_bytes=largest, tensors=n_tensors,
                             mode="pass-through" if pass_through else "gather")
        if self.info is None or self.info.rank == 0:
            log.info("%s", stats)
        return stats

    # ------------------------------------------------------------------ pass-through
    def _iter_local_shards(self) -> Iterator[NamedTensor]:
        from mcpo_megatron.models.builder import stage_layers, unwrap
        from mcpo_megatron.models.weights import megatron_shard_shape, param_rules
        from mcpo_megatron.parallel.distributed import all_gather_objects, broadcast

        if len(self.model_chunks) != 1:
            raise ValueError("pass-through resharding supports one model chunk per rank (no virtual pipeline)")
        model = unwrap(self.model_chunks[0])
        shape = model.mcpo_shape
        te = getattr(model, "mcpo_transformer_impl", "local") == "transformer_engine"
        params = dict(model.named_parameters())
        layers = stage_layers(model)
        info = self.info
        pp_group = info.pp_group if info is not None and info.pp > 1 else None
        # Which pipeline stage owns which part of the model.
        mine = (layers.start, layers.stop, model.pre_process, model.post_process)
        stages = all_gather_objects(mine, group=pp_group) if pp_group is not None else [mine]
        my_stage = info.pp_rank if pp_group is not None else 0
        ref_dtype = next(iter(params.values())).dtype
        send_dtype = self.dtype or ref_dtype
        device = next(iter(params.values())).device

        for rule in param_rules(shape, te=te):
            owner = _owner_stage(rule, stages)
            if owner == my_stage:
                first_layer = stages[owner][0]
                shard = params[rule.mcore_name(first_layer)].detach().to(send_dtype)
            else:
                shard = torch.empty(megatron_shard_shape(shape, rule), dtype=send_dtype, device=device)
            if pp_group is not None:  # on the parameters' device
                broadcast(shard, src=owner, group=pp_group)
            yield from megatron_shard_to_hf_local(rule, shard, shape)
            del shard


def _owner_stage(rule, stages) -> int:
    """Index of the pipeline stage holding ``rule``'s parameter (stages: (start, stop, pre, post))."""
    for s, (start, stop, pre, post) in enumerate(stages):
        if rule.layer is not None:
            if start <= rule.layer < stop:
                return s
        elif rule.mcore.startswith("embedding."):
            if pre:
                return s
        elif post:
            return s
    raise ValueError(f"no pipeline stage holds {rule.mcore} (layer {rule.layer})")


def _device_sync(info) -> Any:
    if info is not None and getattr(info, "device", None) is not None and info.device.type == "cuda":
        return torch.cuda.synchronize
    return lambda: None
