"""Process groups: torch.distributed + megatron-core ``parallel_state`` from a torchrun or srun env, and the
package's collectives.

Every rank calls :func:`init_distributed` once.  It reads the launcher's
environment (torchrun: ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``; SLURM:
``SLURM_PROCID``/``SLURM_NTASKS``/``SLURM_LOCALID``; both with
``MASTER_ADDR``/``MASTER_PORT``), makes the rank's GPU the current device
(:mod:`~mcpo_megatron.parallel.gpu_binding`: the local rank is not the CUDA index
under a per-task GPU binding), starts ``torch.distributed``, builds megatron's
TP/PP/DP groups and seeds the model-parallel RNG streams.  A single process
without any launcher env is a world of one (handy in notebooks and
single-process tests).

Backends.  On a CUDA machine the default group is started with a backend per
device type, ``cpu:gloo,cuda:nccl`` (:func:`default_backend`): CUDA tensors go
over NCCL, CPU tensors (flags, counters, metric sums) over gloo.  Every subgroup
megatron-core or this package creates without naming a backend inherits that
map, so a collective runs on its tensor's own device by construction.  Without
CUDA the group is plain gloo and the CPU shim is applied.

Collectives.  Every collective of the package goes through the functions at the
end of this module (a test reads the package to keep it so; the list of call
sites and their devices is in docs/decisions.md).  For a group whose backend has
no path for the tensor's device (one created with ``backend="nccl"`` alone),
they run the collective on a copy on the group's device and copy the result
back (:func:`comm_device`), instead of failing with "No backend type associated
with device type cpu".
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from mcpo_megatron.parallel import mcore_compat
from mcpo_megatron.parallel.cpu_shim import apply_cpu_shim
from mcpo_megatron.parallel.gpu_binding import bind_this_rank
from mcpo_megatron.parallel.launcher import launcher_env
from mcpo_megatron.parallel.threads import threads_per_process


DEFAULT_TIMEOUT_S = 1800.0  # collective timeout of the default group and megatron's groups


@dataclass
class ParallelInfo:
    """Where this rank sits in the TP x PP x DP layout (megatron order tp-cp-ep-dp-pp).

    Mixture-of-experts layers use a second layout of the same ranks: expert-tensor parallel
    (ETP = TP here) x expert parallel (``ep``: ranks holding different experts) x expert data
    parallel (``world / (pp * ep * etp)``); ``vpp`` is the virtual pipeline size (1: none).
    """

    rank: int
    world_size: int
    local_rank: int
    tp: int
    pp: int
    dp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    is_first_stage: bool
    is_last_stage: bool
    tp_group: Any
    pp_group: Any
    dp_group: Any
    device: torch.device
    ep: int = 1
    ep_rank: int = 0
    ep_group: Any = None
    vpp: int = 1
    cp: int = 1              # context parallel: each sequence split over ``cp`` ranks (models/context_parallel)
    cp_rank: int = 0
    cp_group: Any = None
    dp_cp_group: Any = None  # data x context parallel ranks: what sums a mini-batch's loss and metrics

    @property
    def data_group(self):
        """The group over which this rank's share of the data and its peers' add up to the mini-batch: data x
        context parallel (the data-parallel group when CP = 1)."""
        return self.dp_cp_group if self.dp_cp_group is not None else self.dp_group


def free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_under_torchrun(argv: list[str], nproc: int) -> int:
    """Run the command ``mcpo *argv`` (``python -m mcpo_megatron.cli *argv``) under torchrun with ``nproc``
    processes on this machine; its exit code.

    For commands started without a launcher that need one rank per model-parallel shard. Each process gets
    an equal share of the cores unless ``OMP_NUM_THREADS`` is set.
    """
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "mcpo_megatron.cli", *argv]
    print("launching: " + " ".join(cmd), flush=True)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(threads_per_process(nproc)))
    return subprocess.call(cmd, env=env)


def under_launcher() -> bool:
    """True when torchrun or srun started this process (a command started by hand launches torchrun itself)."""
    return "RANK" in os.environ or ("SLURM_PROCID" in os.environ and "SLURM_NTASKS" in os.environ)


def init_distributed(
    tp: int = 1,
    pp: int = 1,
    *,
    backend: str | None = None,
    seed: int = 0,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    vpp: int | None = None,
    ep: int = 1,
    cp: int = 1,
) -> ParallelInfo:
    """Start torch.distributed and megatron's model-parallel groups; return this rank's layout.

    Args:
        tp, pp: tensor / pipeline model-parallel sizes; ``world_size`` must be a
            multiple of ``tp * pp``; the rest is data parallel.
        ep: expert-parallel size of mixture-of-experts layers (experts split over ``ep``
            ranks of the data-parallel dimension; expert-tensor parallel = ``tp``), so
            ``world_size`` must be a multiple of ``tp * pp * ep``.
        backend: a torch.distributed backend string; default :func:`default_backend` (``cpu:gloo,cuda:nccl``
            with CUDA, else ``gloo``).  ``"nccl"`` alone gives CUDA tensors only a backend: the
            collectives below then stage CPU tensors through the GPU.
        seed: base seed; megatron's tracker derives the per-TP-rank stream
            (``seed + 2718 + tp_rank``) and the data-parallel default stream
            (``seed``), and the CPU generator is seeded with ``seed`` too.
        timeout_s: collective timeout.
        vpp: optional virtual pipeline (interleaved schedule) size.
        cp: context-parallel size (each packed sequence split over ``cp`` ranks); ``world_size`` must be a
            multiple of ``tp * pp * cp``, the data-parallel size is ``world_size / (tp * pp * cp)``.
    """
    rank, world, _ = launcher_env()
    _check_layout(world, tp=tp, pp=pp, ep=ep, vpp=vpp, cp=cp)
    mcore_compat.require_supported()
    cuda = torch.cuda.is_available()
    backend = _checked_backend(backend, cuda)
    if not cuda:
        apply_cpu_shim()  # megatron-core's torch.cuda calls, redirected to the CPU (CPU machines only)

    device = bind_this_rank() if cuda else torch.device("cpu")
    if not dist.is_initialized():
        _init_process_group(backend, rank=rank, world=world, timeout_s=timeout_s)
    _init_megatron_groups(tp=tp, pp=pp, vpp=vpp, ep=ep, cp=cp, timeout_s=timeout_s)

    from megatron.core import tensor_parallel

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return parallel_info(device=device)


def _check_layout(world: int, *, tp: int, pp: int, ep: int, vpp: int | None, cp: int = 1) -> None:
    for key, value in (("tp", tp), ("pp", pp), ("ep", ep), ("cp", cp)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"init_distributed: {key}={value!r} must be a positive integer")
    if world % (tp * pp * ep) != 0:
        raise ValueError(
            f"init_distributed: world_size={world} is not divisible by tp*pp*ep={tp}*{pp}*{ep}; "
            "launch a multiple of tp*pp*ep processes or change the parallel sizes"
        )
    if world % (tp * pp * cp) != 0:
        raise ValueError(
            f"init_distributed: world_size={world} is not divisible by tp*pp*cp={tp}*{pp}*{cp}; "
            "launch a multiple of tp*pp*cp processes or change the parallel sizes"
        )
    if vpp not in (None, 1) and (not isinstance(vpp, int) or vpp < 1 or pp < 2):
        raise ValueError(f"init_distributed: vpp={vpp!r} must be a positive integer, and > 1 only with pp > 1")


def _checked_backend(backend: str | None, cuda: bool) -> str:
    """``backend`` (default: :func:`default_backend`), refused when torch.distributed has no such backend or it
    needs CUDA this machine lacks."""
    if backend is None:
        backend = default_backend(cuda)
    types = backend_device_types(backend)
    if not types:
        raise ValueError(f"init_distributed: backend={backend!r} is not a torch.distributed backend "
                         "(e.g. 'gloo', 'nccl' or 'cpu:gloo,cuda:nccl')")
    if "cuda" in types and backend_for_device(backend, "cuda") != "gloo" and not cuda:
        raise ValueError(f"init_distributed: backend={backend!r} needs CUDA, which is not available here; "
                         "use 'gloo'")
    return backend


def _init_process_group(backend: str, *, rank: int, world: int, timeout_s: float) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    # A world of one (a tool started without a launcher) takes a free port, so it never collides with a
    # training job on the same machine; launched jobs use the launcher's port or 29500.
    os.environ.setdefault("MASTER_PORT", str(free_port()) if world == 1 else "29500")
    dist.init_process_group(
        backend=backend,
        init_method="env://",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )


def _init_megatron_groups(*, tp: int, pp: int, vpp: int | None, ep: int, cp: int, timeout_s: float) -> None:
    """megatron's TP / CP / PP / DP / EP groups (once per process)."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vpp if vpp not in (None, 1) else None,
            expert_model_parallel_size=ep,
            context_parallel_size=cp,
            distributed_timeout_minutes=max(1, int(timeout_s // 60)),
        )


def parallel_info(device: torch.device | None = None) -> ParallelInfo:
    """The :class:`ParallelInfo` of this rank after :func:`init_distributed`."""
    from megatron.core import parallel_state as ps

    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return ParallelInfo(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=launcher_env()[2],
        tp=ps.get_tensor_model_parallel_world_size(),
        pp=ps.get_pipeline_model_parallel_world_size(),
        dp=ps.get_data_parallel_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        is_first_stage=ps.is_pipeline_first_stage(ignore_virtual=True),
        is_last_stage=ps.is_pipeline_last_stage(ignore_virtual=True),
        tp_group=ps.get_tensor_model_parallel_group(),
        pp_group=ps.get_pipeline_model_parallel_group(),
        dp_group=ps.get_data_parallel_group(),
        device=device,
        ep=ps.get_expert_model_parallel_world_size(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        ep_group=ps.get_expert_model_parallel_group(),
        vpp=ps.get_virtual_pipeline_model_parallel_world_size() or 1,
        cp=ps.get_context_parallel_world_size(),
        cp_rank=ps.get_context_parallel_rank(),
        cp_group=ps.get_context_parallel_group(),
        dp_cp_group=ps.get_data_parallel_group(with_context_parallel=True),
    )


def destroy_distributed() -> None:
    """Tear down megatron's groups and the default process group (safe to call twice)."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    _forget_groups()


def new_gloo_group(timeout_s: float):
    """A gloo group of every rank of the default group, with a collective timeout of its own (for ranks that wait
    longer than the default group's timeout allows, e.g. for rollout engines); None without a process group or in
    a world of one. Collective: every rank calls it, in the same order as its other groups."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


# --------------------------------------------------------------------------- backends
def default_backend(cuda: bool) -> str:
    """The default group's backend: NCCL for CUDA tensors and gloo for CPU tensors on a CUDA machine, else gloo."""
    return "cpu:gloo,cuda:nccl" if cuda else "gloo"


def _backend_map(backend: str) -> dict[str, str]:
    """``{device type: backend}`` of a backend string: ``'gloo'`` (its devices), ``'cpu:gloo,cuda:nccl'``."""
    text = str(backend).strip().lower()
    if ":" not in text:
        return {d: text for d in dist.Backend.backend_capability.get(text, ())}
    pairs = [part.split(":") for part in text.split(",") if part.strip()]
    if any(len(pair) != 2 for pair in pairs):
        return {}
    return {device.strip(): name.strip() for device, name in pairs}


def backend_device_types(backend: str) -> frozenset[str]:
    """Device types a backend string has a backend for (empty for an unknown string)."""
    return frozenset(_backend_map(backend))


def backend_for_device(backend: str, device_type: str) -> str | None:
    """The backend that ``backend`` uses for ``device_type`` tensors (None when it has none)."""
    return _backend_map(backend).get(device_type)


def comm_device(tensor_device: torch.device, device_types: frozenset[str]) -> torch.device:
    """The device a collective of a tensor on ``tensor_device`` runs on, over a group whose backend covers
    ``device_types``: the tensor's own device when the group has a backend for it, else the group's (the
    current CUDA device for an NCCL-only group, the CPU for a gloo-only one)."""
    if tensor_device.type in device_types:
        return tensor_device
    if "cuda" in device_types:
        return torch.device("cuda", torch.cuda.current_device())
    if "cpu" in device_types:
        return torch.device("cpu")
    raise RuntimeError(f"no communication backend for {tensor_device.type} tensors in a group whose backend "
                       f"covers {sorted(device_types)}")


_GROUP_DEVICE_TYPES: dict[Any, frozenset[str]] = {}


def _group_device_types(group) -> frozenset[str]:
    key = group if group is not None else dist.group.WORLD
    types = _GROUP_DEVICE_TYPES.get(key)
    if types is None:
        types = _GROUP_DEVICE_TYPES[key] = backend_device_types(dist.get_backend_config(group))
    return types


def _forget_groups() -> None:
    _GROUP_DEVICE_TYPES.clear()


def _active(group) -> bool:
    return dist.is_initialized() and dist.get_world_size(group) > 1


def _on_comm_device(tensor: torch.Tensor, group, collective) -> torch.Tensor:
    """Run ``collective(t)`` (in place on ``t``) on ``tensor``, staged through the group's device when the
    group has no backend for the tensor's device; returns ``tensor``."""
    device = comm_device(tensor.device, _group_device_types(group))
    if device == tensor.device:
        collective(tensor)
        return tensor
    staged = tensor.to(device)
    collective(staged)
    tensor.copy_(staged)
    return tensor


# --------------------------------------------------------------------------- collectives
_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def all_reduce(tensor: torch.Tensor, op: str = "sum", group=None) -> torch.Tensor:
    """In-place all-reduce (``op``: sum | max | min) over ``group`` (no-op without a process group or for a
    group of one); returns ``tensor``.  Runs on the tensor's device (see :func:`comm_device`)."""
    if _active(group):
        reduce_op = _REDUCE_OPS[op]
        _on_comm_device(tensor, group, lambda t: dist.all_reduce(t, op=reduce_op, group=group))
    return tensor


def all_reduce_sum(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """In-place SUM all-reduce over ``group`` (no-op without a process group); returns ``tensor``."""
    return all_reduce(tensor, "sum", group)


def all_reduce_max(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """In-place MAX all-reduce over ``group`` (no-op without a process group); returns ``tensor``."""
    return all_reduce(tensor, "max", group)


def broadcast(tensor: torch.Tensor, src: int, group=None) -> torch.Tensor:
    """In-place broadcast from ``src``, a rank *of the group* (0..size-1), to every rank of ``group``."""
    if _active(group):
        src_global = dist.get_global_rank(group, src) if group is not None else src
        _on_comm_device(tensor, group, lambda t: dist.broadcast(t, src=src_global, group=group))
    return tensor


def all_gather(tensor: torch.Tensor, group=None) -> list[torch.Tensor]:
    """Every rank's ``tensor`` (same shape on all ranks), in group-rank order, on the tensor's device."""
    if not _active(group):
        return [tensor]
    device = comm_device(tensor.device, _group_device_types(group))
    parts = [torch.empty_like(tensor, device=device) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.to(device).contiguous(), group=group)
    return [p.to(tensor.device) for p in parts]


def all_gather_into(out: torch.Tensor, tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Every rank's ``tensor`` (same size) concatenated in group-rank order into ``out`` (``size x numel``), a
    preallocated buffer on the tensor's device; without a process group a copy. Returns ``out``."""
    if not _active(group):
        out.copy_(tensor.reshape(out.shape))
        return out
    device = comm_device(tensor.device, _group_device_types(group))
    if device == tensor.device:
        dist.all_gather_into_tensor(out, tensor.contiguous(), group=group)
        return out
    staged = torch.empty(out.shape, dtype=out.dtype, device=device)
    dist.all_gather_into_tensor(staged, tensor.to(device).contiguous(), group=group)
    out.copy_(staged)
    return out


def all_to_all_bytes(recv: torch.Tensor, send: torch.Tensor, recv_sizes: list[int], send_sizes: list[int],
                     group=None, *, async_op: bool = False):
    """``all_to_all_single`` of flat ``torch.uint8`` buffers: ``send_sizes[i]`` bytes of ``send`` go to group rank
    ``i``, ``recv_sizes[i]`` bytes from it land in ``recv``, in rank order. Both buffers on the device the group has
    a backend for (the reshard plan's buffers live there). Returns the work handle with ``async_op``, else None."""
    if recv.dtype != torch.uint8 or send.dtype != torch.uint8:
        raise TypeError(f"all_to_all_bytes: buffers must be torch.uint8, got {send.dtype} and {recv.dtype}")
    return dist.all_to_all_single(recv, send, output_split_sizes=list(recv_sizes),
                                  input_split_sizes=list(send_sizes), group=group, async_op=async_op)


def broadcast_object(obj: Any, src: int = 0, group=None) -> Any:
    """Broadcast a picklable object from global rank ``src`` to every rank of ``group``."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return obj
    box = [obj if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def all_gather_objects(obj: Any, group=None) -> list[Any]:
    """Gather one picklable object from every rank of ``group``, in group-rank order."""
    if not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def barrier(group=None) -> None:
    """Wait for every rank of ``group`` (no-op without a process group)."""
    if dist.is_initialized():
        dist.barrier(group=group)
