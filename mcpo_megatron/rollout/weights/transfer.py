"""Runs one rank's part of a reshard plan (:mod:`~mcpo_megatron.rollout.weights.plan`): local pieces copied
straight from the source parameter into the live destination tensor, remote pieces packed into one reused buffer
per round, exchanged with one ``all_to_all`` per round, and unpacked into the destinations.

:class:`PlanTransfer` binds a :class:`~mcpo_megatron.rollout.weights.plan.RankPlan` to tensors: ``sources``
(plan source key -> this rank's Megatron parameter) and ``destinations`` (destination key -> the engine's live
tensor). Every view is ``tensor.as_strided`` of a contiguous tensor; the views are built once and rebuilt only
when a bound tensor's storage moved (``trainer.offload`` gives parameters new storage each step). The send and
receive buffers are sized to the largest round, on the device the exchange runs on: kept from one update to the
next in host memory (allocating pages again would cost as much as the copy), taken for the update only on a GPU
(from the caching allocator, so nothing stays beside the engine's KV cache and the training state).

The exchange is a function, so the same code serves the trainer world's group (colocated engines), the bridge
between trainer and engine ranks (separate placement), and an in-process simulation in the tests:
``exchange(recv_buf, send_buf, recv_sizes, send_sizes)`` with the sizes per transfer-group rank, returning a
waitable (``wait()``) or None when it already completed. Every rank calls it once per round, the same number of
rounds on every rank (the plan pads them).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Mapping

import torch

from mcpo_megatron.models.shard_views import View
from mcpo_megatron.parallel.pinned import host_buffer
from mcpo_megatron.rollout.weights.layouts import DTYPE_BYTES
from mcpo_megatron.rollout.weights.plan import RankPlan

Exchange = Callable[[torch.Tensor, torch.Tensor, list[int], list[int]], object]

TORCH_DTYPES = {name: getattr(torch, name) for name in DTYPE_BYTES}


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise ValueError(f"weights of dtype {dtype} cannot be resharded; expected one of {sorted(DTYPE_BYTES)}")
    return name


def strided(tensor: torch.Tensor, view: View) -> torch.Tensor:
    """``view`` of ``tensor`` (contiguous; its own storage offset added)."""
    return tensor.as_strided(view.shape, view.stride, tensor.storage_offset() + view.offset)


def check_bound(plan_keys, tensors: Mapping, what: str, extents: Mapping) -> None:
    """Every key the plan reads or writes is bound to a contiguous tensor that holds its views."""
    missing = sorted(map(str, set(plan_keys) - set(tensors)))
    if missing:
        raise KeyError(f"the reshard plan needs {what} tensors that are not bound: {missing[:5]}"
                       f"{' ...' if len(missing) > 5 else ''}")
    for key in plan_keys:
        t = tensors[key]
        if not t.is_contiguous():
            raise ValueError(f"{what} tensor {key!r} is not contiguous: the plan's views assume row-major storage")
        if extents.get(key, 0) > t.numel():
            raise ValueError(f"{what} tensor {key!r} has {t.numel()} elements; the plan reaches element "
                             f"{extents[key]}: the engine's layout differs from the plan's")


@dataclass
class TransferStats:
    seconds: float
    bytes: int          # bytes written into this rank's destinations
    local_bytes: int
    sent_bytes: int
    received_bytes: int
    rounds: int         # collective calls (one all_to_all each)


class PlanTransfer:
    """One rank's plan, bound to its tensors (see the module docstring).

    ``sources`` may be None on a rank that sends nothing (an engine rank); ``destinations`` None on a rank that
    receives nothing (a trainer rank of separate placement). ``device``: where the packed buffers live (the device
    the exchange runs on). ``staged``: the send buffer holds every round at once (packed by :meth:`stage`, sent later
    from :meth:`send_buffer`: separate placement's snapshot of a version), in pinned memory with ``pin_memory``."""

    def __init__(self, plan: RankPlan, *, sources: Mapping | None, destinations: Mapping | None,
                 device: torch.device, staged: bool = False, pin_memory: bool = False):
        self.plan = plan
        self.device = torch.device(device)
        src_ext: dict = {}
        dst_ext: dict = {}
        for p in self._all_pieces():
            if p.src_rank == plan.rank:
                src_ext[p.src.key] = max(src_ext.get(p.src.key, 0), p.src.extent())
            if p.dst_rank == plan.rank:
                dst_ext[p.dst.key] = max(dst_ext.get(p.dst.key, 0), p.dst.extent())
        sources, destinations = dict(sources or {}), dict(destinations or {})
        check_bound(src_ext, sources, "source", src_ext)
        check_bound(dst_ext, destinations, "destination", dst_ext)
        self.sources = {k: sources[k] for k in src_ext}
        self.destinations = {k: destinations[k] for k in dst_ext}
        self._round_base, base = [], 0
        for rd in plan.rounds:  # where each round's sends start in the send buffer
            self._round_base.append(base if staged else 0)
            base += rd.send_bytes
        self._buffer_bytes = (base if staged else plan.max_send_bytes, plan.max_recv_bytes)
        self._pin_memory = pin_memory
        self._keep_buffers = staged or self.device.type != "cuda"
        self._send_buf = self._recv_buf = None
        self._views = None
        self._ptrs = None

    def rebind(self, *, sources: Mapping | None = None, destinations: Mapping | None = None) -> None:
        """Bind other tensors under the same keys (an engine's tensors after it was rebuilt); the views are rebuilt
        when any storage moved."""
        if sources is not None:
            missing = set(self.sources) - set(sources)
            if missing:
                raise KeyError(f"rebind: source tensors missing: {sorted(map(str, missing))[:5]}")
            self.sources = {k: sources[k] for k in self.sources}
        if destinations is not None:
            missing = set(self.destinations) - set(destinations)
            if missing:
                raise KeyError(f"rebind: destination tensors missing: {sorted(map(str, missing))[:5]}")
            self.destinations = {k: destinations[k] for k in self.destinations}

    def _all_pieces(self):
        yield from self.plan.local
        for rd in self.plan.rounds:
            for items in rd.sends.values():
                yield from (p for _, p in items)
            for items in rd.recvs.values():
                yield from (p for _, p in items)

    # ------------------------------------------------------------------ views
    def _storage_ptrs(self) -> tuple:
        return tuple(t.untyped_storage().data_ptr() for t in (*self.sources.values(), *self.destinations.values()))

    @torch.no_grad()
    def _build_views(self) -> None:
        """The strided views of every piece, and the slices of the packed buffers they travel in."""
        plan, world = self.plan, self.plan.world
        local = [(strided(self.destinations[p.dst.key], p.dst), strided(self.sources[p.src.key], p.src))
                 for p in plan.local]
        rounds = []
        for k, rd in enumerate(plan.rounds):
            send_sizes = [rd.send_sizes.get(peer, 0) for peer in range(world)]
            recv_sizes = [rd.recv_sizes.get(peer, 0) for peer in range(world)]
            packs, unpacks = [], []
            base = self._round_base[k]
            for peer in range(world):
                for offset, p in rd.sends.get(peer, ()):
                    buf = self._slot(self._send_buf, base + offset, p)
                    packs.append((buf, strided(self.sources[p.src.key], p.src)))
                base += send_sizes[peer]
            base = 0
            for peer in range(world):
                for offset, p in rd.recvs.get(peer, ()):
                    buf = self._slot(self._recv_buf, base + offset, p)
                    unpacks.append((strided(self.destinations[p.dst.key], p.dst), buf))
                base += recv_sizes[peer]
            rounds.append((packs, unpacks, send_sizes, recv_sizes, sum(send_sizes), sum(recv_sizes)))
        self._views = (local, rounds)
        self._ptrs = self._storage_ptrs()

    @staticmethod
    def _slot(buf: torch.Tensor, offset: int, p) -> torch.Tensor:
        n = p.nbytes
        return buf[offset:offset + n].view(TORCH_DTYPES[p.dtype]).view(p.src.shape)

    def views(self):
        if self._send_buf is None:
            self._send_buf = byte_buffer(self._buffer_bytes[0], self.device, pin_memory=self._pin_memory)
            self._recv_buf = byte_buffer(self._buffer_bytes[1], self.device)
            self._views = None
        if self._views is None or self._ptrs != self._storage_ptrs():
            self._build_views()
        return self._views

    def release(self) -> None:
        """Drop the buffers (and the views into them) unless they are kept between updates."""
        if not self._keep_buffers:
            self._send_buf = self._recv_buf = self._views = None

    # ------------------------------------------------------------------ running
    def pack(self, k: int) -> tuple[torch.Tensor, list[int]]:
        """Round ``k``'s send buffer, filled, and its sizes per peer."""
        _, rounds = self.views()
        _copy_all(rounds[k][0])
        return self.send_buffer(k)

    def send_buffer(self, k: int) -> tuple[torch.Tensor, list[int]]:
        """Round ``k``'s send buffer as it is, and its sizes per peer."""
        _, rounds = self.views()
        _, _, send_sizes, _, total, _ = rounds[k]
        base = self._round_base[k]
        return self._send_buf[base:base + total], send_sizes

    def stage(self) -> int:
        """Pack every round (a staged transfer's snapshot of its sources); returns the bytes packed. From CUDA
        sources into pinned memory the copies are asynchronous on the current stream."""
        _, rounds = self.views()
        for packs, *_ in rounds:
            _copy_all(packs, non_blocking=True)
        return int(self._send_buf.numel())

    def receive_buffer(self, k: int) -> tuple[torch.Tensor, list[int]]:
        _, rounds = self.views()
        _, _, _, recv_sizes, _, total = rounds[k]
        return self._recv_buf[:total], recv_sizes

    def unpack(self, k: int) -> None:
        _, rounds = self.views()
        _copy_all(rounds[k][1])

    def copy_local(self) -> None:
        local, _ = self.views()
        _copy_all(local)

    def run(self, exchange: Exchange | None) -> TransferStats:
        """Copy the local pieces and run every round (``exchange`` per round; None: the plan has no rounds)."""
        t0 = time.perf_counter()
        if self.plan.num_rounds and exchange is None:
            raise ValueError("this plan has rounds: an exchange over the transfer group is needed")
        done_local = False
        for k in range(self.plan.num_rounds):
            send, send_sizes = self.pack(k)
            recv, recv_sizes = self.receive_buffer(k)
            work = exchange(recv, send, recv_sizes, send_sizes)
            if not done_local:  # overlaps the first exchange
                self.copy_local()
                done_local = True
            if work is not None:
                work.wait()
            self.unpack(k)
        if not done_local:
            self.copy_local()
        self.release()
        counts = self.plan.byte_counts()
        received = sum(p.nbytes for rd in self.plan.rounds for items in rd.recvs.values() for _, p in items)
        local = sum(p.nbytes for p in self.plan.local)
        return TransferStats(seconds=time.perf_counter() - t0, bytes=received + local, local_bytes=local,
                             sent_bytes=counts["sent"], received_bytes=counts["received"],
                             rounds=self.plan.num_rounds)


def byte_buffer(nbytes: int, device: torch.device, *, pin_memory: bool = False) -> torch.Tensor:
    """A flat ``torch.uint8`` buffer on ``device``; with ``pin_memory`` page-locked host memory of exactly
    ``nbytes`` (:func:`~mcpo_megatron.parallel.pinned.host_buffer`, not torch's power-of-two pinned allocator)."""
    if pin_memory:
        return host_buffer(nbytes, pinned=True, what="the staged weights for the engines")
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


@torch.no_grad()
def _copy_all(pairs: list[tuple[torch.Tensor, torch.Tensor]], non_blocking: bool = False) -> None:
    """``dst.copy_(src)`` for every pair (one multi-tensor launch per run of same-dtype pairs on a GPU)."""
    if not pairs:
        return
    if pairs[0][0].is_cuda and pairs[0][1].is_cuda:
        groups: dict = {}
        for dst, src in pairs:
            groups.setdefault((dst.dtype, src.dtype), ([], []))
            groups[(dst.dtype, src.dtype)][0].append(dst)
            groups[(dst.dtype, src.dtype)][1].append(src)
        for dsts, srcs in groups.values():
            torch._foreach_copy_(dsts, srcs)
        return
    for dst, src in pairs:
        dst.copy_(src, non_blocking=non_blocking)
