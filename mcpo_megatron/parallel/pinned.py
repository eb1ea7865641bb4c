"""Page-locked host memory of exactly the size asked for: every pinned buffer of the project comes from
:func:`host_buffer`.

Why not ``torch.empty(..., pin_memory=True)``: it goes through torch's caching host allocator, which rounds each
allocation up to the next power of two (torch 2.13, ``include/ATen/core/CachingHostAllocator.h`` 300-309:
``c10::llvm::PowerOf2Ceil(size)`` whenever the size is below ``pinned_max_round_threshold``, unlimited by default,
``include/c10/core/AllocatorConfig.h`` 361), and keeps the block cached after it is freed: a 9 GiB staging buffer
would take 16 GiB of locked host memory. Instead the memory is allocated as ordinary host memory and page-locked
with CUDA's host registration (``cudaHostRegister`` through ``torch.cuda.cudart()``), which locks the pages of
exactly the range given. The range starts on a page boundary and its pages belong to no other allocation, so two
buffers never share a registered page.

The registration lasts as long as the memory: it is undone (``cudaHostUnregister``) when the last tensor viewing
the buffer is gone, before the memory is freed (the buffer's memory is a NumPy array, whose weak references are
cleared before it frees its data; the finalizer is such a reference).
"""

from __future__ import annotations

import mmap
import weakref

import numpy as np
import torch

PAGE = mmap.PAGESIZE


def host_buffer(nbytes: int, *, pinned: bool, what: str, remedy: str = "") -> torch.Tensor:
    """A flat ``torch.uint8`` host tensor of ``nbytes`` (contents undefined); with ``pinned``, page-locked for
    asynchronous copies to and from a GPU, exactly ``nbytes`` of it. ``what`` names the buffer (and ``remedy`` a
    way around) in the error raised when the host cannot lock that much memory."""
    nbytes = int(nbytes)
    if not pinned or nbytes == 0:
        return torch.empty(nbytes, dtype=torch.uint8)
    raw = np.empty(nbytes + 2 * PAGE, dtype=np.uint8)  # room to start on a page and to end on one of its own
    start = -raw.ctypes.data % PAGE
    region = raw[start:start + nbytes]
    ptr = region.ctypes.data
    err = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0))
    if err != 0:
        raise RuntimeError(f"page-locking {nbytes / 2**30:.2f} GiB of host memory for {what} failed with CUDA "
                           f"error {err}; the node's RAM (or its locked-memory limit, ulimit -l) cannot hold it: "
                           f"see mcpo plan's host memory lines{remedy}")
    weakref.finalize(raw, _unregister, ptr).atexit = False  # at exit the process's memory goes anyway
    return torch.from_numpy(region)


def _unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)
