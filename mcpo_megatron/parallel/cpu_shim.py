"""CPU/gloo support for megatron-core (0.16.1 to 0.19.x): the one place that fakes ``torch.cuda``.

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
* CUDA streams and events (megatron's MoE all-to-all dispatcher copies its
  split sizes to the host on a side stream and waits on an event) become
  no-op stand-ins: on the CPU every operation is already synchronous.  The
  dispatcher's host copy (``maybe_move_tensor_to_cpu(..., as_numpy=True)``)
  converts only CUDA tensors, so on the CPU its all-to-all split sizes stayed
  tensors, which ``all_to_all_single`` rejects; the stand-in returns them as
  numpy arrays as on a GPU.
* Uneven all-gather / reduce-scatter along the first dimension (megatron's
  ``tensor_parallel.mappings`` with split sizes: the MoE dispatcher's
  expert-tensor-parallel exchange) use list collectives with tensors of
  different sizes, which gloo refuses.  The stand-ins pad to the largest split
  for an equal-size all-gather and trim, and reduce-scatter as an all-reduce
  followed by this rank's slice (same values; more traffic, CPU only).
* The distributed optimizer's gradient reduce-scatter and parameter all-gather over a group of one rank (a
  data-parallel size of 1: TP or PP alone) are skipped when the shard is the whole bucket, the same memory, as
  it then always is: the sum over one rank is the bucket itself, yet gloo copies it through its own buffers
  (about 1 s a step for 135M fp32 values, docs/benchmarks.md). NCCL's are device copies and stay as they are.

* megatron's Gated DeltaNet imports its kernels from flash-linear-attention (Triton) and causal-conv1d, which
  do not run on a CPU; the plain-torch references of ``cpu_linear_attention`` take their place in the GDN
  modules' namespaces (``_install_linear_attention_references``), and the GDN's ``jit_fuser``
  (``torch.compile``) helpers run as the plain functions they wrap (``_run_gdn_helpers_eagerly``).  On a GPU
  machine the shim is not applied and the real packages are required (megatron raises its own ImportError
  without them).

megatron's optimizer is left as it is: on a CPU it loads Adam's step exactly as on a GPU without TE or Apex,
and ``mcore_compat.restore_adam_steps`` repairs that load on every device (a fix here would hide from the CPU
tests what a GPU run does).

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


class _CpuEvent:
    """Stand-in for ``torch.cuda.Event``: everything it could wait for has already happened."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        return None

    def wait(self, stream=None):
        return None

    def synchronize(self):
        return None

    def query(self):
        return True


class _CpuStream:
    """Stand-in for ``torch.cuda.Stream`` (work on the CPU runs in order, synchronously)."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream):
        return None

    def wait_event(self, event):
        return None

    def record_event(self, event=None):
        return event if event is not None else _CpuEvent()

    def synchronize(self):
        return None

    def query(self):
        return True


_DEFAULT_STREAM = _CpuStream()


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

    _patch_cuda_module()
    _patch_moe_host_copies()
    _patch_uneven_collectives()
    _patch_single_rank_bucket_collectives()
    _patch_cuda_rng()
    _patch_tensor_factories()
    _patch_megatron_rng()
    _install_linear_attention_references()

    _APPLIED = True
    return True


def _noop(*args, **kwargs):
    return None


def _zero(*args, **kwargs):
    return 0


def _patch(module, name, fn):
    """``module.name`` becomes a stand-in calling ``fn``."""
    # A separate function object per name: dynamo rejects one object under two names.
    @functools.wraps(fn)
    def stand_in(*args, **kwargs):
        return fn(*args, **kwargs)

    setattr(module, name, stand_in)


def _patch_cuda_module() -> None:
    """Device queries, memory statistics, NVTX ranges, streams and events of ``torch.cuda``."""
    cuda = torch.cuda
    _patch(cuda, "current_device", lambda: torch.device("cpu"))
    _patch(cuda, "device_count", lambda: 1)
    for name in ("set_device", "synchronize", "empty_cache", "reset_peak_memory_stats"):
        _patch(cuda, name, _noop)
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved",
                 "max_memory_reserved"):
        _patch(cuda, name, _zero)
    _patch(cuda, "memory_stats", lambda *a, **k: {})
    _patch(cuda.nvtx, "range_push", _noop)
    _patch(cuda.nvtx, "range_pop", _noop)
    _patch(cuda.nvtx, "range", lambda *a, **k: contextlib.nullcontext())

    # Streams and events: synchronous stand-ins (the CPU has one implicit, in-order stream).
    cuda.Stream = _CpuStream
    cuda.Event = _CpuEvent
    _patch(cuda, "current_stream", lambda *a, **k: _DEFAULT_STREAM)
    _patch(cuda, "default_stream", lambda *a, **k: _DEFAULT_STREAM)
    _patch(cuda, "stream", lambda *a, **k: contextlib.nullcontext())
    torch.Tensor.record_stream = lambda self, stream: None


def _patch_moe_host_copies() -> None:
    """The MoE dispatcher's host copy of its split sizes returns numpy arrays for CPU tensors too."""
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    orig_move = moe_utils.maybe_move_tensor_to_cpu

    @functools.wraps(orig_move)
    def move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor):
            return tensor.numpy()
        return orig_move(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = move_tensor_to_cpu


def _patch_uneven_collectives() -> None:
    """megatron's all-gather / reduce-scatter along the first dimension with split sizes, on gloo."""
    from megatron.core.tensor_parallel import mappings

    orig_gather = mappings._gather_along_first_dim
    orig_reduce_scatter = mappings._reduce_scatter_along_first_dim

    @functools.wraps(orig_gather)
    def gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return orig_gather(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(n) for n in output_split_sizes]
        padded = input_.new_zeros((max(sizes),) + tuple(input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        out = input_.new_empty((len(sizes) * max(sizes),) + tuple(input_.shape[1:]))
        torch.distributed.all_gather_into_tensor(out, padded.contiguous(), group=group)
        return torch.cat([part[:n] for part, n in zip(out.chunk(len(sizes)), sizes)])

    @functools.wraps(orig_reduce_scatter)
    def reduce_scatter_along_first_dim(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return orig_reduce_scatter(input_, group, input_split_sizes, use_global_buffer)
        total = input_.contiguous().clone()
        torch.distributed.all_reduce(total, group=group)
        return list(torch.split(total, [int(n) for n in input_split_sizes]))[group.rank()].contiguous()

    mappings._gather_along_first_dim = gather_along_first_dim
    mappings._reduce_scatter_along_first_dim = reduce_scatter_along_first_dim


def skip_single_rank_copy(collective):
    """``collective(output, input, ...)`` (a reduce-scatter or all-gather into a tensor) made a no-op where it
    moves nothing: a group of one rank and an ``output`` that is ``input``'s memory. Inside megatron's
    ``_coalescing_manager`` a skipped call leaves nothing to wait for (its handle's ``wait`` then returns)."""

    @functools.wraps(collective)
    def call(output, input_, *args, group=None, async_op=False, **kwargs):
        if (group is not None and group.size() == 1 and output.data_ptr() == input_.data_ptr()
                and output.numel() == input_.numel() and output.dtype == input_.dtype):
            return None
        return collective(output, input_, *args, group=group, async_op=async_op, **kwargs)

    call._mcpo_cpu_shim = True
    return call


def _patch_single_rank_bucket_collectives() -> None:
    """The DDP buckets' reduce-scatter and all-gather (module docstring), bound by megatron at import."""
    from megatron.core.distributed import param_and_grad_buffer as buckets

    for name in ("dist_reduce_scatter_func", "dist_all_gather_func"):
        fn = getattr(buckets, name)
        if not getattr(fn, "_mcpo_cpu_shim", False):
            setattr(buckets, name, skip_single_rank_copy(fn))


def _patch_cuda_rng() -> None:
    """The CUDA RNG becomes the CPU default generator."""
    for module in (torch.cuda, torch.cuda.random):
        _patch(module, "get_rng_state", lambda device="cuda": torch.get_rng_state())
        _patch(module, "set_rng_state",
               lambda new_state, device="cuda": torch.set_rng_state(new_state))
        _patch(module, "manual_seed", lambda seed: torch.default_generator.manual_seed(int(seed)))
        _patch(module, "manual_seed_all",
               lambda seed: torch.default_generator.manual_seed(int(seed)))


def _patch_tensor_factories() -> None:
    """Tensor factories, ``Tensor.cuda``, ``Tensor.to`` and ``Tensor.type`` (module docstring)."""
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


def _patch_megatron_rng() -> None:
    """megatron's tracker reads/writes the RNG through its own helpers."""
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = (
        lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    )
    mrandom._set_cuda_rng_state = (
        lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)
    )



# The modules of megatron's Gated DeltaNet that bind the flash-linear-attention names at import: 0.16.1 has one
# module (it leaves ``l2norm`` unbound when fla is missing, and falls back to its nn.Conv1d when causal-conv1d's
# ``causal_conv1d_fn`` is None, which runs on the CPU as it is); 0.19 a package whose common.py imports the
# kernels, fla's ``causal_conv1d`` included, and whose gdn.py and __init__.py re-bind them.
_GDN_MODULES = (
    "megatron.core.ssm.gated_delta_net",
    "megatron.core.ssm.gated_delta_net.common",
    "megatron.core.ssm.gated_delta_net.gdn",
)


def _install_linear_attention_references() -> None:
    """Bind the CPU references of ``cpu_linear_attention`` where megatron's GDN looks its kernels up."""
    import importlib

    from mcpo_megatron.parallel import cpu_linear_attention

    for name in _GDN_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            continue  # the other release's layout
        module.l2norm = cpu_linear_attention.l2norm
        module.chunk_gated_delta_rule = cpu_linear_attention.chunk_gated_delta_rule
        if hasattr(module, "causal_conv1d"):  # 0.19 only
            module.causal_conv1d = cpu_linear_attention.causal_conv1d
        if hasattr(module, "HAVE_FLA"):
            module.HAVE_FLA = True
    _run_gdn_helpers_eagerly()


def _run_gdn_helpers_eagerly() -> None:
    """The GDN's ``jit_fuser`` (``torch.compile``) helpers run as the plain functions they wrap.

    On a CPU, inductor compiles each of them (the gated norm; in 0.19 also the q/k/v preparation and the decay)
    for every new dtype and sequence length, seconds each, more than the tiny CPU models' whole step; the fusion
    changes no value.  GPUs keep megatron's compiled helpers (the shim is not applied there).
    """
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    for cls in GatedDeltaNet.__mro__:
        if not cls.__module__.startswith("megatron.core.ssm."):
            continue  # the GDN's own classes (0.19: GatedDeltaNet and its _GDNBase), not MegatronModule's
        for attr, value in list(vars(cls).items()):
            orig = getattr(value, "_torchdynamo_orig_callable", None)
            if orig is not None:
                setattr(cls, attr, orig)
