"""Weight resharding: the trainer's Megatron shards -> the rollout engine, streamed in buckets.

The models package's :func:`~mcpo_megatron.models.hf_io.iter_hf_tensors` yields each full Hugging Face tensor
on every rank (TP shards gathered, pipeline stages exchanging their layers, fused QKV / gate-up split into HF
tensors); the engine slices what it needs (vLLM's loaders cut each rank's TP shard themselves, for any rollout
TP). The tensors are fresh copies.

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
    number of buckets, the largest bucket's bytes and tensors sent."""

    seconds: float
    bytes: int
    gbps: float
    buckets: int
    max_bucket_bytes: int
    tensors: int

    def __str__(self) -> str:
        return (f"reshard: {self.bytes / 1e9:.3f} GB in {self.seconds:.3f} s = {self.gbps:.2f} GB/s, "
                f"{self.tensors} tensors in {self.buckets} buckets (largest {self.max_bucket_bytes / 2**20:.1f} MiB)")


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


class Resharder:
    """Streams the policy's weights into a rollout engine.

    Args:
        model_chunks: this rank's bare ``GPTModel`` chunks (``MegatronPolicy.model_chunks``).
        hf_config: the Hugging Face config of the model.
        bucket_mb: bucket size in MiB (``reshard.bucket_mb``).
        parallel_info: this rank's :class:`~mcpo_megatron.parallel.distributed.ParallelInfo`
            (for logging and the device; default from ``parallel_state``).
        dtype: cast tensors to this dtype for the engine (e.g. bf16 for vLLM); None keeps it.
    """

    def __init__(self, model_chunks, hf_config, *, bucket_mb: float = 512, parallel_info=None, dtype: torch.dtype | None = None):
        if not bucket_mb > 0:
            raise ValueError(f"Resharder: bucket_mb={bucket_mb!r} must be > 0 (MiB per bucket)")
        self.model_chunks = list(model_chunks)
        self.hf_config = hf_config
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.dtype = dtype
        if parallel_info is None and torch.distributed.is_initialized():
            from mcpo_megatron.parallel.distributed import parallel_info as _pi

            parallel_info = _pi()
        self.info = parallel_info

    # ------------------------------------------------------------------ stream
    def iter_tensors(self) -> Iterator[NamedTensor]:
        """The ``(hf_name, tensor)`` stream of one update: every full HF tensor."""
        from mcpo_megatron.models.hf_io import iter_hf_tensors

        return iter_hf_tensors(self.model_chunks, self.hf_config, dtype=self.dtype)

    def iter_buckets(self) -> Iterator[list[NamedTensor]]:
        """Buckets of at most ``bucket_mb`` MiB; a larger single tensor travels alone."""
        return bucketize(self.iter_tensors(), self.bucket_bytes)

    # ------------------------------------------------------------------ push
    def push(self, engine) -> ReshardStats:
        """Stream every weight into ``engine.update_weights`` bucket by bucket, between the engine's
        ``begin_update`` and ``finish_update`` (when it has them); return the stats."""
        sync = _device_sync(self.info)
        sync()
        start = time.perf_counter()
        total = n_buckets = n_tensors = largest = 0
        begin = getattr(engine, "begin_update", None)
        if begin is not None:
            begin()
        for bucket in self.iter_buckets():
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
                             buckets=n_buckets, max_bucket_bytes=largest, tensors=n_tensors)
        if self.info is None or self.info.rank == 0:
            log.info("%s", stats)
        return stats


def _device_sync(info) -> Any:
    if info is not None and getattr(info, "device", None) is not None and info.device.type == "cuda":
        return torch.cuda.synchronize
    return lambda: None
