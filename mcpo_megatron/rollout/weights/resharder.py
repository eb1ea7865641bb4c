"""Weight resharding: the trainer's Megatron shards -> the rollout engines, every iteration.

Two paths, chosen once per engine and agreed by every rank of the transfer group:

* **the compiled plan** (engines with a :meth:`~mcpo_megatron.rollout.engines.interface.RolloutEngine.weight_target`: the
  PyTorch engine, vLLM's): :mod:`~mcpo_megatron.rollout.weights.plan` lists, for every engine destination tensor,
  the source ranks, views and offsets it comes from; it is compiled at the first update (one object gather and
  two small MAX all-reduces) and kept. Each update copies the pieces a rank holds straight into its engine's live
  tensors and moves the others through one reused buffer per round with one ``all_to_all`` per round
  (:mod:`~mcpo_megatron.rollout.weights.transfer`): no tensor is gathered whole, nothing is allocated per update,
  and a rank receives only what its engine shard needs. With the trainer's TP equal to vLLM's and one pipeline
  stage there is no collective at all.
* **the Hugging Face stream** (any other engine, and a remote publisher's staging): the models package's
  :func:`~mcpo_megatron.models.hf_io.iter_hf_tensors` yields each full HF tensor on every rank, grouped into
  buckets of at most ``bucket_mb`` MiB (a tensor larger than that travels alone) for ``engine.update_weights``.

:meth:`Resharder.push` returns and logs the seconds, bytes and GB/s of the update, and how many collectives it
made.
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
    """One weight update: wall seconds, bytes delivered to this rank's engine, GB/s (1e9 B/s), buckets (the plan's
    rounds), the largest bucket's bytes, tensors written, and how: ``path`` ("plan" or "stream"), the collectives
    of the update (``collectives``) and the plan's bytes copied locally and sent to other ranks."""

    seconds: float
    bytes: int
    gbps: float
    buckets: int
    max_bucket_bytes: int
    tensors: int
    path: str = "stream"
    collectives: int = 0
    local_bytes: int = 0
    sent_bytes: int = 0

    def __str__(self) -> str:
        return (f"reshard ({self.path}): {self.bytes / 1e9:.3f} GB in {self.seconds:.3f} s = {self.gbps:.2f} GB/s, "
                f"{self.tensors} tensors in {self.buckets} {'rounds' if self.path == 'plan' else 'buckets'} "
                f"(largest {self.max_bucket_bytes / 2**20:.1f} MiB), {self.collectives} collectives")


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def bucketize(named: Iterable[NamedTensor], bucket_bytes: int) -> Iterator[list[NamedTensor]]:
    """Group a stream of tensors into lists of at most ``bucket_bytes`` (an oversized
    tensor forms its own bucket), preserving order."""
    if bucket_bytes < 1:
        raise ValueError(f"bucketize: bucket_bytes={bucket_bytes} must be >= 1")
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


def trainer_coordinates(model_chunks, rank: int):
    """This trainer rank's part of a plan's :class:`~mcpo_megatron.rollout.weights.layouts.TrainerLayout`: its
    Megatron coordinates (``rank``: its rank in the transfer group) and the model's (shape, layer spec, stage of each
    layer)."""
    from megatron.core import parallel_state as ps

    from mcpo_megatron.models.builder import unwrap
    from mcpo_megatron.models.hf_io import layer_stages
    from mcpo_megatron.rollout.weights.layouts import TrainerRank

    model = unwrap(list(model_chunks)[0])
    me = TrainerRank(rank, ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank(),
                     dp=ps.get_data_parallel_rank(), cp=ps.get_context_parallel_rank(),
                     ep=ps.get_expert_model_parallel_rank(), edp=ps.get_expert_data_parallel_rank())
    te = model.mcpo_transformer_impl == "transformer_engine"
    return me, (model.mcpo_shape, te, tuple(layer_stages(model.config)))


def compile_for_group(model_chunks, layout, *, has_engine: bool, rank: int, bucket_bytes: int, gather, agree):
    """This rank's :class:`~mcpo_megatron.rollout.weights.plan.RankPlan` over a transfer group, or None on every
    rank when some engine has no weight target (then every rank takes the HF stream). A trainer rank passes its
    ``model_chunks``, a rank with an engine (``has_engine``) its weight target's ``layout`` (None: it has none).
    ``gather(obj)`` returns every rank's object in group order, ``agree(int)`` the largest over the group: both
    collective."""
    from mcpo_megatron.rollout.weights import layouts as L, plan as P

    mine = trainer_coordinates(model_chunks, rank) if model_chunks is not None else (None, None)
    gathered = gather((mine, layout, has_engine))
    if any(engine and lay is None for _, lay, engine in gathered) or all(me is None for (me, _), _, _ in gathered):
        return None
    ranks = tuple(me for (me, _), _, _ in gathered if me is not None)
    shape, te, stages = next(what for (_, what), _, _ in gathered if what is not None)
    trainer = L.TrainerLayout(shape, te, stages, ranks)
    engines = [lay for _, lay, _ in gathered]
    return P.compile_rank_plan(trainer, engines, rank, P.preferences(trainer, engines), bucket_bytes,
                               max_over_ranks=agree)


def compile_plan(model_chunks, layout, *, bucket_bytes: int, group=None):
    """:func:`compile_for_group` over a torch.distributed ``group`` (colocated: every rank trains and has an
    engine)."""
    from mcpo_megatron.parallel.distributed import all_gather_objects, all_reduce_max

    def agree(x: int) -> int:
        t = torch.tensor([int(x)], dtype=torch.int64)
        return int(all_reduce_max(t, group).item())

    return compile_for_group(model_chunks, layout, has_engine=True, rank=_group_rank(group),
                             bucket_bytes=bucket_bytes, gather=lambda obj: all_gather_objects(obj, group), agree=agree)


def _group_rank(group) -> int:
    import torch.distributed as dist

    return dist.get_rank(group) if dist.is_initialized() else 0


class Resharder:
    """Pushes the policy's weights into a rollout engine (see the module docstring).

    Args:
        model_chunks: this rank's bare ``GPTModel`` chunks (``MegatronPolicy.model_chunks``).
        hf_config: the Hugging Face config of the model.
        bucket_mb: MiB per bucket (``reshard.bucket_mb``): the HF stream's bucket, and the plan's per-round buffer.
        parallel_info: this rank's :class:`~mcpo_megatron.parallel.distributed.ParallelInfo`
            (for logging and the device; default from ``parallel_state``).
        dtype: the HF stream's dtype for the engine (e.g. bf16 for vLLM); None keeps the model's. The plan writes
            in each engine tensor's own dtype.
        group: the transfer group of the plan (default: the whole world, every rank an engine's).
    """

    def __init__(self, model_chunks, hf_config, *, bucket_mb: float = 512, parallel_info=None,
                 dtype: torch.dtype | None = None, group=None):
        if not bucket_mb > 0:
            raise ValueError(f"Resharder: bucket_mb={bucket_mb!r} must be > 0 (MiB per bucket)")
        self.model_chunks = list(model_chunks)
        self.hf_config = hf_config
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.dtype = dtype
        self.group = group
        if parallel_info is None and torch.distributed.is_initialized():
            from mcpo_megatron.parallel.distributed import parallel_info as _pi

            parallel_info = _pi()
        self.info = parallel_info
        self._planned: dict[int, bool] = {}  # id(engine) -> every rank's engine takes the plan
        self._transfers: dict[Any, Any] = {}  # engine layout -> PlanTransfer
        from mcpo_megatron.models.hf_io import StreamBuffers

        self._stream_buffers = StreamBuffers()

    # ------------------------------------------------------------------ stream
    def iter_buckets(self, counts: dict | None = None) -> Iterator[list[NamedTensor]]:
        """The HF stream of one update: every full HF tensor, in buckets of at most ``bucket_mb`` MiB (a larger
        tensor travels alone) that stay valid until the next bucket is asked for (``counts["collectives"]`` counts
        the stream's collectives)."""
        from mcpo_megatron.models.hf_io import iter_hf_buckets

        return iter_hf_buckets(self.model_chunks, self.hf_config, dtype=self.dtype, bucket_bytes=self.bucket_bytes,
                               buffers=self._stream_buffers, counts=counts)

    # ------------------------------------------------------------------ push
    def push(self, engine, *, stream: bool = False) -> ReshardStats:
        """Write every weight into ``engine``: through the compiled plan when every rank's engine has a weight
        target, else (or with ``stream``, on every rank) the HF stream (``begin_update`` / ``update_weights`` per
        bucket / ``finish_update``)."""
        sync = _device_sync(self.info)
        sync()
        start = time.perf_counter()
        target = None if stream else self._planned_target(engine)
        stats = self._push_planned(target) if target is not None else self._push_stream(engine)
        sync()
        stats.seconds = time.perf_counter() - start
        stats.gbps = stats.bytes / max(stats.seconds, 1e-12) / 1e9
        if self.info is None or self.info.rank == 0:
            log.info("%s", stats)
        return stats

    def _planned_target(self, engine):
        """The engine's weight target when every rank of the group has one (agreed once per engine)."""
        get = getattr(engine, "weight_target", None)
        target = get() if get is not None else None
        key = id(engine)
        if key not in self._planned:
            from mcpo_megatron.parallel.distributed import all_reduce

            flag = torch.tensor([int(target is not None)], dtype=torch.int32)
            self._planned[key] = bool(all_reduce(flag, "min", self.group).item())
        return target if self._planned[key] else None

    def transfer_for(self, target):
        """The bound :class:`~mcpo_megatron.rollout.weights.transfer.PlanTransfer` for ``target`` (compiled at its
        first use: collective)."""
        from mcpo_megatron.models.hf_io import source_tensors
        from mcpo_megatron.rollout.weights.transfer import PlanTransfer

        transfer = self._transfers.get(target.layout)
        if transfer is None:
            plan = compile_plan(self.model_chunks, target.layout, bucket_bytes=self.bucket_bytes, group=self.group)
            device = self.info.device if self.info is not None else torch.device("cpu")
            transfer = PlanTransfer(plan, sources=source_tensors(self.model_chunks), destinations=target.tensors,
                                    device=device)
            self._transfers[target.layout] = transfer
        else:
            transfer.rebind(destinations=target.tensors)
        return transfer

    def _push_planned(self, target) -> ReshardStats:
        from mcpo_megatron.parallel.distributed import all_to_all_bytes

        transfer = self.transfer_for(target)

        def exchange(recv, send, recv_sizes, send_sizes):
            return all_to_all_bytes(recv, send, recv_sizes, send_sizes, self.group, async_op=True)

        if target.begin is not None:
            target.begin()
        with torch.no_grad():
            t = transfer.run(exchange)
        if target.finish is not None:
            target.finish()
        plan = transfer.plan
        return ReshardStats(seconds=t.seconds, bytes=t.bytes, gbps=0.0, buckets=plan.num_rounds,
                            max_bucket_bytes=max(plan.max_send_bytes, plan.max_recv_bytes),
                            tensors=len(plan.destinations), path="plan", collectives=t.rounds,
                            local_bytes=t.local_bytes, sent_bytes=t.sent_bytes)

    def _push_stream(self, engine) -> ReshardStats:
        total = n_buckets = n_tensors = largest = 0
        counts = {"collectives": 0}
        begin = getattr(engine, "begin_update", None)
        if begin is not None:
            begin()
        for bucket in self.iter_buckets(counts):
            size = sum(tensor_bytes(t) for _, t in bucket)
            engine.update_weights(bucket)
            total += size
            n_buckets += 1
            n_tensors += len(bucket)
            largest = max(largest, size)
            del bucket  # the engine copied it; the next bucket reuses its buffers
        finish = getattr(engine, "finish_update", None)
        if finish is not None:
            finish()
        return ReshardStats(seconds=0.0, bytes=total, gbps=0.0, buckets=n_buckets, max_bucket_bytes=largest,
                            tensors=n_tensors, path="stream", collectives=counts["collectives"])


def _device_sync(info) -> Any:
    if info is not None and getattr(info, "device", None) is not None and info.device.type == "cuda":
        return torch.cuda.synchronize
    return lambda: None
