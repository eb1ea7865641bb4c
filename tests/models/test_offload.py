"""models/offload.StorageOffload on plain tensors: a storage's memory is really released (0 bytes, no copy kept
beside it on the device) and comes back with the same bits under every view; released-only storages come back
zeroed; and on a (mocked) GPU the copies are asynchronous into pinned memory, synchronised before a storage is
freed and after the copies back, with the allocator cache emptied after the frees."""

from __future__ import annotations

import gc

import pytest
import torch

from mcpo_megatron.models import offload as O


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8).clone()


def test_storage_released_and_restored_under_every_view():
    flat = torch.randn(1000, dtype=torch.float32)
    flat[3] = float("nan")
    flat[4] = -0.0
    views = [flat[:10].view(2, 5), flat[500:], flat[10:20]]  # a parameter, a bucket, a main_grad
    grad = torch.randn(300, dtype=torch.float32)
    grad_view = grad[100:200]
    before = _bits(flat)
    ptr = flat.data_ptr()
    off = O.StorageOffload("cpu")
    stats = off.offload([views[0], views[1]], [grad_view])  # two views of one storage: moved once
    assert stats.copied_bytes == 4000 and stats.released_bytes == 1200 and stats.storages == 2
    assert off.offloaded
    for t in views + [flat]:
        assert t.untyped_storage().nbytes() == 0  # the one storage every view shares is empty
    assert grad.untyped_storage().nbytes() == 0
    assert off.host_bytes == 4000  # the host copy; gradients take no host memory
    back = off.onload()
    assert back.copied_bytes == 4000 and back.released_bytes == 1200 and not off.offloaded
    assert torch.equal(_bits(flat), before)  # NaN payloads and -0.0 included
    assert views[1].untyped_storage()._cdata == flat.untyped_storage()._cdata  # still a view, not a copy
    assert views[1].data_ptr() == flat.data_ptr() + 500 * 4
    assert torch.equal(grad, torch.zeros(300))  # released storages come back zeroed
    assert flat.data_ptr() != 0 and ptr != 0


def test_the_released_memory_is_not_kept_alive_elsewhere():
    """The storage is freed, not copied beside: while offloaded it holds 0 bytes, and what comes back is the host
    copy's bytes and nothing else (a change made to the host copy is what the tensor reads after onload)."""
    big = torch.ones(1 << 20, dtype=torch.float64)  # 8 MiB
    storage = big.untyped_storage()
    off = O.StorageOffload("cpu")
    off.offload([big])
    gc.collect()
    assert storage.nbytes() == 0 and big.untyped_storage().nbytes() == 0
    (arena,) = off._arenas.values()
    assert arena.buffer.numel() == 8 << 20 and off.host_bytes == 8 << 20
    arena.buffer.view(torch.float64).fill_(2.0)
    off.onload()
    assert storage.nbytes() == 8 << 20 and bool((big == 2.0).all())


def test_offload_again_moves_only_what_is_left_and_host_buffers_are_reused():
    a, b = torch.arange(10.0), torch.arange(20.0)
    off = O.StorageOffload("cpu")
    off.offload([a])
    second = off.offload([a, b])  # a is already in host memory: only b moves
    assert second.storages == 1 and second.copied_bytes == 80
    off.onload()
    buffers = {k: arena.buffer.data_ptr() for k, arena in off._arenas.items()}
    assert off.host_bytes == 120
    off.offload([a])
    off.offload([a, b])  # the same storages in the same calls: the same host buffers
    assert {k: arena.buffer.data_ptr() for k, arena in off._arenas.items()} == buffers
    off.onload()
    off.offload([a, b])  # in one call now: a new buffer; the two unused ones go at the next onload
    off.onload()
    assert off.host_bytes == 120 and len(off._arenas) == 1
    assert torch.equal(a, torch.arange(10.0)) and torch.equal(b, torch.arange(20.0))


def test_tensors_on_another_device_and_empty_storages_are_skipped():
    off = O.StorageOffload("cuda:0")  # a CPU tensor is not on the training device: it stays
    t = torch.ones(4)
    assert off.offload([t]).storages == 0 and t.untyped_storage().nbytes() == 16
    off = O.StorageOffload("cpu")
    assert off.offload([torch.empty(0)]).storages == 0


def test_cuda_path_order_with_cuda_mocked(monkeypatch):
    """Offload: asynchronous copies into pinned buffers, then synchronize (before any storage is freed), then the
    frees, then empty_cache. Onload: the allocations and asynchronous copies back, then synchronize before it
    returns (the forward reads restored memory)."""
    events: list = []
    tensors = [torch.randn(64), torch.randn(32)]
    grads = torch.randn(16)
    storages = [t.untyped_storage() for t in tensors + [grads]]
    real_copy = torch.Tensor.copy_

    def copy_(self, src, non_blocking=False):
        events.append(("copy", non_blocking))
        return real_copy(self, src, non_blocking=non_blocking)

    def synchronize(device=None):
        events.append(("sync", [s.nbytes() for s in storages]))

    def empty_cache():
        events.append(("empty_cache", [s.nbytes() for s in storages]))

    class Cudart:  # the page-locking of the host buffer (parallel/pinned.py)
        def cudaHostRegister(self, ptr, nbytes, flags):
            events.append(("pin", nbytes))
            return 0

        def cudaHostUnregister(self, ptr):
            return 0

    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    monkeypatch.setattr(torch.cuda, "empty_cache", empty_cache)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: Cudart())
    monkeypatch.setattr(O.StorageOffload, "_on_device", lambda self, t: True)  # the CPU tensors stand for GPU ones
    off = O.StorageOffload(torch.device("cuda", 0))
    before = [t.clone() for t in tensors]

    off.offload(tensors, [grads])
    assert events[:3] == [("pin", 384), ("copy", True), ("copy", True)]  # one page-locked buffer for both
    assert events[3] == ("sync", [256, 128, 64])  # nothing freed before the copies are complete
    assert events[4] == ("empty_cache", [0, 0, 0])  # after the frees
    assert len(events) == 5

    events.clear()
    off.onload()
    assert events == [("copy", True), ("copy", True), ("sync", [256, 128, 64])]  # synchronised last
    assert all(torch.equal(a, b) for a, b in zip(tensors, before)) and torch.equal(grads, torch.zeros(16))

    events.clear()
    off.offload(tensors)
    assert ("pin", 384) not in events  # the page-locked buffer is kept and reused


def test_offload_parts_from_config():
    from types import SimpleNamespace

    parts = O.OffloadParts.from_config(SimpleNamespace(buffers=True, master_weights=False, moments=True,
                                                       reference=False))
    assert parts == O.OffloadParts(True, False, True, False)


@pytest.mark.parametrize("seconds,gbps", [(0.0, 0.0), (2.0, 0.5)])
def test_move_stats_rate(seconds, gbps):
    assert O.MoveStats(copied_bytes=10**9, seconds=seconds).gbps == gbps
