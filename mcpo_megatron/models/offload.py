"""The training state in host memory while a colocated engine generates (``trainer.offload``).

Between a step's weight update and the next step's first training forward (the old-log-prob pass) the policy's
state is idle, and on a GPU shared with a vLLM engine its memory is the engine's KV cache. :class:`StateOffload`
moves it to host memory and back:

* ``buffers``: megatron DDP's parameter buffers (model dtype: bf16 on GPUs; with the distributed optimizer one
  flat buffer per chunk and dtype, ``buffer.param_data``, which every parameter's ``.data`` is a view of;
  without it each parameter's own storage) and gradient buffers (fp32, ``buffer.grad_data``, which every
  ``param.main_grad`` and every bucket is a view of). Gradients are released without a copy: their values are
  dead between steps (``forward_backward`` zeroes the buffers before it accumulates), and they come back zeroed;
* ``master_weights``: the optimizer's fp32 copies of bf16 parameters (the distributed optimizer's shards; for
  fp32 models the optimizer updates the parameters themselves and there is no separate copy);
* ``moments``: the optimizer state on the training device (Adam's ``exp_avg`` and ``exp_avg_sq``, fp32);
* ``reference``: the frozen reference policy's parameters (``algorithm.kl``; model dtype).

How: every distinct storage is moved whole, as bytes. Its contents are copied into a host buffer of uint8 (one
buffer for the storages of one offload call, page-locked with CUDA by registering it, so that the copies are
asynchronous DMA and take exactly their bytes; a plain tensor on CPU machines, where the code path is otherwise
the same), then the storage is resized to 0 bytes, which frees its memory, and the CUDA allocator's
cache is emptied so that another allocator (the engine's) can take it. Onload resizes each storage back and
copies the bytes in. Resizing keeps the storage object, so every tensor that views it (parameters, ``main_grad``,
megatron's buckets and their overlapped reduce-scatter / all-gather views, the optimizer's shard views) sees the
restored memory: nothing is re-allocated beside it, and the values are the same bits.

Synchronisation (CUDA): copies are issued with ``non_blocking=True`` on the current stream; offload synchronises
the device before it frees a storage (a device-to-host copy must be complete before its source is released and
before its host buffer may be read), and onload synchronises after the host-to-device copies, so the forward that
follows (and any collective on another stream) reads restored memory. The pinned host buffers are kept for the
run and reused (pinning is slow): the host memory this takes is what ``mcpo plan`` reports per node.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

from mcpo_megatron.config.sections.training import OFFLOAD_PARTS
from mcpo_megatron.parallel.pinned import host_buffer


@dataclass(frozen=True)
class OffloadParts:
    """Which parts of the training state leave the device (``trainer.offload``'s booleans)."""

    buffers: bool = True
    master_weights: bool = True
    moments: bool = True
    reference: bool = True

    @classmethod
    def from_config(cls, offload) -> "OffloadParts":
        return cls(**{name: bool(getattr(offload, name)) for name in OFFLOAD_PARTS})


@dataclass
class MoveStats:
    """One offload or onload: bytes copied over the host link, bytes released without a copy (gradients), the
    storages moved and the wall seconds (synchronisation included)."""

    copied_bytes: int = 0
    released_bytes: int = 0
    storages: int = 0
    seconds: float = 0.0

    @property
    def gbps(self) -> float:
        return self.copied_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def __add__(self, other: "MoveStats") -> "MoveStats":
        return MoveStats(self.copied_bytes + other.copied_bytes, self.released_bytes + other.released_bytes,
                         self.storages + other.storages, self.seconds + other.seconds)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _empty_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``, asynchronous between pinned host memory and a GPU (the caller synchronises)."""
    dst.copy_(src, non_blocking=True)


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole ``storage``, on its device."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _key(storage: torch.UntypedStorage) -> int:
    """The identity of the storage object (its StorageImpl), shared by every tensor that views it."""
    return storage._cdata


class _Arena:
    """One host buffer (uint8) for the storages one :meth:`StorageOffload.offload` call copies, each at its
    offset; pinned with CUDA (exactly its bytes, :func:`~mcpo_megatron.parallel.pinned.host_buffer`). Kept and
    reused while the same storages move."""

    def __init__(self, nbytes: int, pinned: bool):
        self.buffer = host_buffer(nbytes, pinned=pinned, what="trainer.offload's copies",
                                  remedy=", or set trainer.offload.enable=false")

    def release(self) -> None:
        """Let the buffer go (its registration ends with its last view)."""
        self.buffer = torch.empty(0, dtype=torch.uint8)


@dataclass
class _Moved:
    storage: torch.UntypedStorage
    nbytes: int
    host: torch.Tensor | None   # its bytes in an arena; None: released without a copy, zeroed when restored


class StorageOffload:
    """Moves whole storages to host memory and back; see the module docstring.

    ``device`` is the training device; only storages on it move. Storages are given as tensors that view them;
    a storage given twice moves once, and one already offloaded is skipped, so :meth:`offload` may be called
    again with more (the weights after the engine has read them)."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self._moved: dict[int, _Moved] = {}
        self._arenas: dict[tuple, _Arena] = {}  # by the (storage, size) list they hold, reused
        self._used: set[tuple] = set()          # the arenas of the offloads since the last onload

    @property
    def offloaded(self) -> bool:
        return bool(self._moved)

    @property
    def host_bytes(self) -> int:
        """Host memory held for the copies (pinned with CUDA)."""
        return sum(a.buffer.numel() for a in self._arenas.values())

    def _on_device(self, t: torch.Tensor) -> bool:
        d = t.device
        return d.type == self.device.type and (d.index is None or self.device.index is None
                                               or d.index == self.device.index)

    def _storages(self, tensors: Iterable[torch.Tensor]) -> Iterator[torch.UntypedStorage]:
        seen = set()
        for t in tensors:
            if t is None or not self._on_device(t):
                continue
            s = t.untyped_storage()
            k = _key(s)
            if k in seen or k in self._moved or s.nbytes() == 0:
                continue
            seen.add(k)
            yield s

    def _arena(self, storages: list[torch.UntypedStorage]) -> _Arena:
        layout = tuple((_key(s), s.nbytes()) for s in storages)
        if layout not in self._arenas:
            self._arenas[layout] = _Arena(sum(n for _, n in layout), pinned=self.device.type == "cuda")
        self._used.add(layout)
        return self._arenas[layout]

    def offload(self, copy: Iterable[torch.Tensor], release: Iterable[torch.Tensor] = ()) -> MoveStats:
        """Copy the storages of ``copy`` to host memory and free them; free those of ``release`` without a copy
        (a storage in both is copied). Returns what moved."""
        t0 = time.perf_counter()
        stats = MoveStats()
        to_copy = list(self._storages(copy))
        copied = {_key(s) for s in to_copy}
        to_release = [s for s in self._storages(release) if _key(s) not in copied]
        if not to_copy and not to_release:
            return stats
        arena, offset = self._arena(to_copy), 0
        for s in to_copy:
            nbytes = s.nbytes()
            host = arena.buffer[offset:offset + nbytes]
            _copy(host, _bytes_of(s))
            self._moved[_key(s)] = _Moved(s, nbytes, host)
            offset += nbytes
            stats.copied_bytes += nbytes
        for s in to_release:
            self._moved[_key(s)] = _Moved(s, s.nbytes(), None)
            stats.released_bytes += s.nbytes()
        _synchronize(self.device)  # the copies are complete before their sources are freed
        for s in to_copy + to_release:
            s.resize_(0)
        _empty_cache(self.device)  # the freed blocks go back to the driver, for the engine's allocator
        stats.storages = len(to_copy) + len(to_release)
        stats.seconds = time.perf_counter() - t0
        return stats

    def onload(self) -> MoveStats:
        """Every offloaded storage back on the device, at its size, with its bytes (released ones zeroed);
        the copies are complete when it returns."""
        t0 = time.perf_counter()
        stats = MoveStats(storages=len(self._moved))
        if not self._moved:
            return stats
        for m in self._moved.values():
            m.storage.resize_(m.nbytes)
            if m.host is None:
                _bytes_of(m.storage).zero_()
                stats.released_bytes += m.nbytes
            else:
                _copy(_bytes_of(m.storage), m.host)
                stats.copied_bytes += m.nbytes
        _synchronize(self.device)  # the forward that follows reads restored memory
        self._moved.clear()
        for layout in set(self._arenas) - self._used:  # storages that no longer move (a checkpoint load
            self._arenas.pop(layout).release()         # replaced a tensor): their host memory goes
        self._used = set()
        stats.seconds = time.perf_counter() - t0
        return stats


def _inner_optimizers(optimizer) -> list:
    """The torch optimizers inside megatron's (chained, distributed or mixed-precision) optimizer."""
    chained = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [getattr(o, "optimizer", o) for o in chained]


def policy_tensors(policy) -> dict[str, list[torch.Tensor]]:
    """The policy's state by part: ``params`` (every parameter of every chunk: views of the DDP parameter
    buffers with the distributed optimizer), ``grads`` (the DDP gradient buffers, dense and expert),
    ``master_weights`` (optimizer parameters that are not model parameters: fp32 copies of bf16 weights) and
    ``moments`` (the optimizer's state tensors)."""
    params = [p for d in policy.ddps for p in d.module.parameters()]
    param_keys = {_key(p.untyped_storage()) for p in params}
    grads = [b.grad_data for d in policy.ddps for b in list(d.buffers) + list(d.expert_parallel_buffers)
             if b.grad_data is not None]
    inner = _inner_optimizers(policy.optimizer)
    master = [p for o in inner for g in o.param_groups for p in g["params"]
              if _key(p.untyped_storage()) not in param_keys]
    moments = [v for o in inner for state in o.state.values() for v in state.values() if torch.is_tensor(v)]
    return {"params": params, "grads": grads, "master_weights": master, "moments": moments}


class StateOffload:
    """The policy's (and the reference's) state off the device and back, by :class:`OffloadParts`.

    :meth:`offload` with ``keep_params=True`` moves everything but the policy's weights (what a weight update
    into the engine reads); a later :meth:`offload` moves the weights too. :meth:`onload` brings all back. The
    tensors are collected at each call: the optimizer's state is created at its first step and replaced when a
    checkpoint is loaded."""

    def __init__(self, policy, reference=None, parts: OffloadParts = OffloadParts(), device=None):
        self.policy = policy
        self.reference = reference
        self.parts = parts
        self.storages = StorageOffload(device if device is not None else policy.info.device)
        self.last_offload = MoveStats()
        self.last_onload = MoveStats()
        self._pending = MoveStats()

    @property
    def offloaded(self) -> bool:
        return self.storages.offloaded

    def offload(self, *, keep_params: bool = False) -> MoveStats:
        t = policy_tensors(self.policy)
        copy: list[torch.Tensor] = []
        if self.parts.master_weights:
            copy += t["master_weights"]
        if self.parts.moments:
            copy += t["moments"]
        if self.parts.reference and self.reference is not None:
            copy += [p for d in self.reference.ddps for p in d.module.parameters()]
        if self.parts.buffers and not keep_params:
            copy += t["params"]
        stats = self.storages.offload(copy, t["grads"] if self.parts.buffers else ())
        self._pending = self._pending + stats
        return stats

    def onload(self) -> MoveStats:
        """Everything offloaded back on the device; ``last_offload`` becomes the sum of the offloads since the
        previous onload, ``last_onload`` this one."""
        self.last_onload = self.storages.onload()
        self.last_offload, self._pending = self._pending, MoveStats()
        return self.last_onload
