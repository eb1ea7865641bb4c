"""What makes the host wait for a device, counted on a machine without one.

On a GPU, reading a tensor's value into Python (``.item()``, ``bool()``, ``float()``, ``.tolist()``...) waits for
every kernel queued before it, and so does a copy from pageable host memory to the device. :class:`HostReads`
counts the reads of any tensor; :class:`DeviceCopies` counts copies between host memory and another device (the
meta device in the tests: it has no values, so any read of a meta tensor raises, as a sync would show).
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten


class HostReads(TorchFunctionMode):
    """Counts every read of a tensor's value into Python while active (``reads``: the method names, in order)."""

    READS = frozenset({"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy"})

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) in self.READS:
            self.reads.append(func.__name__)
        return func(*args, **(kwargs or {}))


class DeviceCopies(TorchDispatchMode):
    """Counts copies from host memory to another device (``to_device``) and back (``to_host``), with their shapes.
    A copy of a meta tensor to the host, which has no values to copy, gives zeros (so that code which reads its
    results back once can run on the meta device)."""

    def __init__(self):
        super().__init__()
        self.to_device: list[tuple[int, ...]] = []
        self.to_host: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten._to_copy.default and args[0].device.type == "meta" and kwargs.get("device") is not None \
                and torch.device(kwargs["device"]).type == "cpu":
            self.to_host.append(tuple(args[0].shape))
            return torch.zeros(args[0].shape, dtype=kwargs.get("dtype") or args[0].dtype)
        out = func(*args, **kwargs)
        if func is aten._to_copy.default:
            src, dst = args[0], out
        elif func is aten.copy_.default:
            dst, src = args[0], args[1]
        else:
            return out
        if src.device.type == "cpu" and dst.device.type != "cpu":
            self.to_device.append(tuple(src.shape))
        elif src.device.type != "cpu" and dst.device.type == "cpu":
            self.to_host.append(tuple(src.shape))
        return out
