"""What travels between the trainer leader and the engine ranks of ``rollout.placement=separate``: the messages in
the launch's store and the packed weight buckets (:class:`~mcpo_megatron.parallel.bridge.Bridge` carries both).

Protocol (keys in the launch's store; ``n`` counts requests, ``m`` weight asks):

* ``req/n``: the trainer leader submits a generation batch (:class:`GenerateRequest`: prompts, sampling,
  ``min_version``) or :class:`Shutdown`. Every engine rank reads every request, so the engine world works in
  lockstep; requests are served in order.
* before each batch the engine leader asks for weights, ``ask/m`` = (version it holds, ``min_version``); the
  trainer leader answers ``offer/m`` (an :class:`Offer`) at its first fixed point (``rollout/separate/remote.py``) at which
  a version >= ``min_version`` is staged: the staged version if the engines' is older than the batch allows, else
  nothing. Between two segments of a partial batch it may ask again (:class:`InflightAsk`): the engines take a new
  version without draining. An offered version then travels to every engine rank: with the reshard plan from
  every trainer rank's staged shards (``rollout/separate/plan.py``), otherwise broadcast bucket by bucket
  (:func:`pack_bucket`) from the trainer leader's host copy, and loaded through the engine's weight update (for
  vLLM, its weight-transfer lifecycle: ``rollout/engines/vllm/transfer.py``).
* ``res/n``: the engine leader's :class:`GenerateResult`: the samples, the policy version that generated them, and
  the engines' timings (generation, idle, weight waits and transfers).
* ``hb/<bridge rank>``: each engine rank's heartbeat, with the batch it works on and for how long. Every wait of
  the trainer leader on the engines watches them, so a silent engine rank, a batch over
  ``rollout.batch_timeout_s``, or a wait longer than the batches queued may take ends in an error that every
  trainer rank raises (``rollout/separate/liveness.py``).
* the flag ``stop`` (:data:`STOP_FLAG`): set by the trainer when it stops; engines abandon the batch they generate.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from mcpo_megatron.parallel.pinned import host_buffer
from mcpo_megatron.rollout.engines.interface import RolloutOutput, SamplingParams
from mcpo_megatron.rollout.placement import WeightUpdate

ALIGN = 64           # byte offset of each tensor in a packed bucket (any dtype's view of the flat buffer is aligned)
STOP_FLAG = "stop"   # set by the trainer: engines abandon the batch they are generating


@dataclass
class GenerateRequest:
    key: Any
    prompts: list[list[int]]
    sampling: SamplingParams
    first_index: int = 0
    min_version: int = 0


@dataclass
class InflightAsk:
    """The engine leader's ask between two segments of a partial batch (in-flight weight updates): the version it
    holds and the one it may take; ``block``: wait until that version is published (the repeatable mode), else
    take what is published now, if newer."""

    have: int
    want: int
    block: bool


@dataclass
class Shutdown:
    """The last request: the engines leave their loop."""


@dataclass
class GenerateResult:
    key: Any
    output: RolloutOutput | None       # None: generation was interrupted
    version: int
    generate_s: float = 0.0
    idle_s: float = 0.0
    updates: list[WeightUpdate] = field(default_factory=list)
    error: str | None = None           # an exception on the engine ranks (they exit after reporting it)


@dataclass
class TensorMeta:
    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    nbytes: int


@dataclass
class Offer:
    """The publisher's answer to an ask: a version to load (with the bucket layout), none newer, or shutdown."""

    version: int | None
    buckets: list[tuple[list[TensorMeta], int]] = field(default_factory=list)  # (tensors, bucket bytes)
    shutdown: bool = False

    @property
    def bytes(self) -> int:
        return sum(meta.nbytes for metas, _ in self.buckets for meta in metas)


# --------------------------------------------------------------------------- packing
def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


def pack_bucket(bucket: Sequence[tuple[str, torch.Tensor]], out: torch.Tensor | None = None, *,
                pin_memory: bool = False) -> tuple[list[TensorMeta], torch.Tensor]:
    """A reshard bucket as one flat host byte buffer (``out`` reused when its size fits; page-locked, exactly its
    bytes, with ``pin_memory``) and its layout."""
    metas, offset = [], 0
    for name, t in bucket:
        nbytes = t.numel() * t.element_size()
        metas.append(TensorMeta(name, tuple(t.shape), str(t.dtype), offset, nbytes))
        offset += -(-nbytes // ALIGN) * ALIGN
    if out is None or out.numel() != offset:
        out = host_buffer(offset, pinned=pin_memory, what="the trainer leader's copy of the weights for the engines")
    for meta, (_, t) in zip(metas, bucket):
        out[meta.offset:meta.offset + meta.nbytes].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
    return metas, out


def unpack_bucket(metas: Sequence[TensorMeta], flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Views of ``flat`` as the bucket's named tensors."""
    return [(m.name, flat[m.offset:m.offset + m.nbytes].view(_dtype(m.dtype)).view(m.shape)) for m in metas]
