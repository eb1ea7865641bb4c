"""CPU/gloo support for megatron-core 0.16.1: the one place that fakes ``torch.cuda``.

megatron-core assumes a GPU: it creates tensors with ``device="cuda"`` or
``device=torch.cuda.current_device()``, calls ``Tensor.cuda()``, synchronises
streams and keeps a "CUDA" RNG state for tensor-parallel weight init and
dropout (``tensor_parallel.random.CudaRNGStatesTracker``).  On a CPU-only torch
every one of those raises "Torch not compiled with CUDA enabled".

``apply_cpu_shim()`` redirects them to the CPU so that the code paths the
project uses (parallel_state, GPTModel with the local layer spec, TP layers,
vocab-parallel embedding / cross-entropy, the pipeline schedules' p2p
communication, DDP grad buffers, the distributed optimizer, dist_checkpointing)
run unchanged on gloo.  It is applied only when CUDA is absent, is idempotent,
and must run before the first megatron call (``init_distributed`` does it).

What is patched, and why:

* ``torch.cuda.current_device`` returns ``torch.device("cpu")`` (an int ``0``
  would mean ``cuda:0`` when used as a tensor device); ``set_device``,
  ``synchronize``, ``empty_cache``, ``nvtx`` ranges become no-ops;
  ``device_count`` is 1; memory statistics are 0.
* Tensor factories (``torch.tensor``, ``zeros``, ``ones``, ``empty``, ``full``,
  ``arange``, ``*_like``...) map a ``"cuda"`` device argument to ``"cpu"``;
  ``Tensor.cuda()`` returns the tensor unchanged (megatron moves optimizer
  state, checkpoint shards and grad-norm scalars with it); ``Tensor.to`` maps
  a ``"cuda"`` target to the CPU.
* ``Tensor.type()`` (no argument) reports a CPU tensor as ``torch.cuda.*Tensor``:
  megatron's optimizers sort parameters into fp32 / fp16 groups by that
  string and reject anything else.
* The "CUDA" RNG is the CPU default generator: ``torch.cuda.get_rng_state`` /
  ``set_rng_state`` / ``manual_seed`` act on it, and megatron's own
  ``_get_cuda_rng_state`` / ``_set_cuda_rng_state`` (which would otherwise
  queue the state change forever via ``torch.cuda._lazy_call``) are replaced.
  The tracker's ``fork()`` then swaps the CPU generator state in and out, so
  megatron's per-TP-rank streams stay separate and reproducible.
* ``DistributedOptimizer.load_state_dict`` (torch-Adam path, taken whenever
  Apex/TE are absent) shares one ``step`` tensor among all parameters, so
  Adam's in-place ``step += 1`` counts once per parameter; the wrapper gives
  each parameter its own copy (a resumed run then steps exactly like an
  uninterrupted one).

The patches are process-wide (a CPU-only process has no other use for
``torch.cuda``).  Not needed: gloo runs megatron's ``batch_isend_irecv`` pipeline p2p as is.
"""

from __future__ import annotations

import contextlib
import functools

import torch

_APPLIED = False

# Factory functions megatron-core calls with a device argument.
_FACTORIES = (
    "tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "rand",
    "randn", "randint", "empty_like", "zeros_like", "ones_like", "full_like",
    "empty_strided", "randperm",
)


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # A bare int device is a CUDA index (torch.cuda.current_device() used to return one).
    return isinstance(device, int) and not isinstance(device, bool)


def _cpu_device(device):
    return torch.device("cpu") if _is_cuda(device) else device


def _wrap_factory(fn):
    @functools.wraps(fn)
    def factory(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        # Pinned memory needs an accelerator; it is only a speed hint.
        kwargs.pop("pin_memory", None)
        return fn(*args, **kwargs)

    factory._mcpo_cpu_shim = True
    return factory


def _tensor_to(orig):
    @functools.wraps(orig)
    def to(self, *args, **kwargs):
        args = tuple(_cpu_device(a) for a in args)
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return orig(self, *args, **kwargs)

    return to


def _tensor_type(orig):
    @functools.wraps(orig)
    def type_(self, *args, **kwargs):
        if args or kwargs:
            return orig(self, *args, **kwargs)
        name = orig(self)
        # 'torch.FloatTensor' -> 'torch.cuda.FloatTensor': the optimizers sort params by it.
        return name.replace("torch.", "torch.cuda.", 1) if self.device.type == "cpu" else name

    return type_


def apply_cpu_shim() -> bool:
    """Make megatron-core's ``torch.cuda`` calls work on a CPU-only torch.

    Returns True when the shim is active (applied now or before), False when
    CUDA is available and nothing was changed.
    """
    global _APPLIED
    if _APPLIED:
        return True
    if torch.cuda.is_available():
        return False

    # torch._dynamo builds a one-off map of torch callables the first time it is
    # used; build it now, from the unpatched functions, so that our stand-ins
    # are neither reported as duplicates nor mistaken for torch builtins.
    from torch._dynamo import trace_rules

    trace_rules.get_torch_obj_rule_map()

    def noop(*args, **kwargs):
        return None

    def zero(*args, **kwargs):
        return 0

    def patch(module, name, fn):
        # A separate function object per name: dynamo rejects one object under two names.
        @functools.wraps(fn)
        def stand_in(*args, **kwargs):
            return fn(*args, **kwargs)

        setattr(module, name, stand_in)

    cuda = torch.cuda
    patch(cuda, "current_device", lambda: torch.device("cpu"))
    patch(cuda, "device_count", lambda: 1)
    for name in ("set_device", "synchronize", "empty_cache", "reset_peak_memory_stats"):
        patch(cuda, name, noop)
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved",
                 "max_memory_reserved"):
        patch(cuda, name, zero)
    patch(cuda, "memory_stats", lambda *a, **k: {})
    patch(cuda.nvtx, "range_push", noop)
    patch(cuda.nvtx, "range_pop", noop)
    patch(cuda.nvtx, "range", lambda *a, **k: contextlib.nullcontext())

    # The CUDA RNG becomes the CPU default generator.
    for module in (cuda, cuda.random):
        patch(module, "get_rng_state", lambda device="cuda": torch.get_rng_state())
        patch(module, "set_rng_state",
              lambda new_state, device="cuda": torch.set_rng_state(new_state))
        patch(module, "manual_seed", lambda seed: torch.default_generator.manual_seed(int(seed)))
        patch(module, "manual_seed_all",
              lambda seed: torch.default_generator.manual_seed(int(seed)))

    # torch's `with torch.device(...)` context (used by transformers' from_pretrained with "meta") works from
    # a cached list of the factory functions; build it from the originals, or the context would no longer
    # reach them and "meta" tensors would silently be created on the CPU.
    from torch.utils import _device as torch_device_context

    torch_device_context._device_constructors()
    for name in _FACTORIES:
        fn = getattr(torch, name)
        if not getattr(fn, "_mcpo_cpu_shim", False):
            setattr(torch, name, _wrap_factory(fn))
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.Tensor.to = _tensor_to(torch.Tensor.to)
    torch.Tensor.type = _tensor_type(torch.Tensor.type)

    # megatron's tracker reads/writes the RNG through its own helpers.
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = (
        lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    )
    mrandom._set_cuda_rng_state = (
        lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)
    )

    # Without Apex/TE, DistributedOptimizer.load_state_dict gives every parameter
    # the SAME 'step' tensor; torch's Adam then increments it once per parameter
    # and the bias correction of every later step is wrong.  Un-share it.
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    orig_load = DistributedOptimizer.load_state_dict

    @functools.wraps(orig_load)
    def load_state_dict(self, state_dict):
        out = orig_load(self, state_dict)
        for param_state in self.optimizer.state.values():
            if torch.is_tensor(param_state.get("step")):
                param_state["step"] = param_state["step"].detach().clone()
        return out

    DistributedOptimizer.load_state_dict = load_state_dict

    _APPLIED = True
    return True
