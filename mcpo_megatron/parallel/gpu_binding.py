"""Which CUDA device a rank uses: one rule for the trainer ranks, the engine ranks, vLLM and ``mcpo selftest``.

A launcher either shows every process of a node all the node's GPUs (torchrun; srun without a GPU binding), or
binds each task to GPUs of its own (srun ``--gpus-per-task``, ``--gpu-bind``, a site's default binding):
``CUDA_VISIBLE_DEVICES`` then lists only the task's GPUs, which CUDA numbers 0..k-1 inside the process. The
local rank is an index into the devices a process sees only in the first case, so it is not the CUDA index in
general. :func:`cuda_device_index` decides the index from the local rank, the number of ranks on the node, the
number of devices this process sees and whether the launcher bound them:

* no more ranks on the node than devices seen: the local rank (every GPU of the node visible, or a task's own
  set large enough to number its ranks);
* fewer devices than ranks, under a per-task binding: the local rank modulo the devices seen when they divide
  the ranks; with one GPU per task that is device 0, with k GPUs shared by k consecutive tasks (a binding to
  the GPUs close to each task's cores) each task takes its own one;
* otherwise there are not enough GPUs for one per rank: an error naming the numbers and what to change.

torchrun's processes inherit one ``CUDA_VISIBLE_DEVICES``, so under torchrun no process of a node is bound apart
from the others: each needs a device of its own among those they all see.

The rule cannot see a binding that gives two tasks the same GPU (a ``CUDA_VISIBLE_DEVICES`` set by hand for every
task): ``mcpo selftest`` compares the device UUIDs of all ranks and fails on a shared one.

Everything here but :func:`bind_this_rank` is plain arithmetic on its arguments and the environment, so it is
tested with CUDA mocked, apart from the CPU shim.
"""

from __future__ import annotations

import os
import re

import torch

from mcpo_megatron.parallel.launcher import env_int, launcher_env

VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"


def cuda_device_index(local_rank: int, local_world_size: int | None, device_count: int,
                      visible_devices: str | None, *, torchrun: bool = False) -> int:
    """The CUDA index (among the devices this process sees) that this rank uses.

    Args:
        local_rank: this rank's index among the ranks of its node.
        local_world_size: the number of ranks on the node (None: unknown; then only one device per task, or a
            local rank below the device count, can be placed).
        device_count: CUDA devices this process sees (``torch.cuda.device_count()``).
        visible_devices: ``CUDA_VISIBLE_DEVICES`` as the launcher set it (None or empty: unset, no binding).
        torchrun: torchrun started the node's processes (they share one ``CUDA_VISIBLE_DEVICES``).
    """
    if device_count < 1:
        raise RuntimeError(f"this process sees no CUDA device ({VISIBLE_DEVICES}={visible_devices!r}); give the "
                           "task a GPU (srun --gpus-per-task, --gpus-per-node) or run without CUDA")
    if local_rank < 0 or (local_world_size is not None and local_rank >= local_world_size):
        raise ValueError(f"local rank {local_rank} is outside the node's {local_world_size} ranks; check the "
                         "launcher's LOCAL_RANK / SLURM_LOCALID and LOCAL_WORLD_SIZE / SLURM_NTASKS_PER_NODE")
    if local_rank < device_count and (local_world_size is None or local_world_size <= device_count):
        return local_rank
    bound = bool((visible_devices or "").strip()) and not torchrun
    ranks = "an unknown number of" if local_world_size is None else str(local_world_size)
    if bound and (device_count == 1 or (local_world_size is not None and local_world_size % device_count == 0)):
        return local_rank % device_count
    if not bound:
        why = ("torchrun's processes share one CUDA_VISIBLE_DEVICES" if torchrun
               else f"{VISIBLE_DEVICES} is not set, so no task is bound to GPUs of its own")
        remedy = (f"launch at most {device_count} ranks per node (srun --ntasks-per-node, torchrun "
                  "--nproc_per_node), or one srun task per GPU with a GPU binding (srun --gpus-per-task=1)")
    else:
        why = (f"a binding of {device_count} GPUs per task places {ranks} ranks only when {device_count} divides "
               "the ranks of the node" + (" (set LOCAL_WORLD_SIZE or SLURM_NTASKS_PER_NODE)"
                                          if local_world_size is None else ""))
        remedy = "bind one GPU per task (srun --gpus-per-task=1) or launch as many ranks per node as GPUs"
    raise RuntimeError(f"cannot give local rank {local_rank} a GPU of its own: the node runs {ranks} ranks and this "
                       f"process sees {device_count} CUDA device(s) ({VISIBLE_DEVICES}={visible_devices!r}); "
                       f"{why}: {remedy}")


def slurm_tasks_on_this_node(tasks_per_node: str, node_id: int | None) -> int | None:
    """Tasks on node ``node_id`` from SLURM's compressed per-node list (``"4(x2),3"``: 4, 4, 3); None when the
    list is not of that form or the node cannot be told (no id and the nodes differ)."""
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if match is None:
            return None
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    if len(set(counts)) == 1:
        return counts[0]
    if node_id is None or not 0 <= node_id < len(counts):
        return None
    return counts[node_id]


def local_world_size_from_env() -> int | None:
    """Ranks on this node: torchrun's ``LOCAL_WORLD_SIZE``, else the srun step's tasks on this node
    (``SLURM_STEP_TASKS_PER_NODE`` / ``SLURM_TASKS_PER_NODE`` at ``SLURM_NODEID``, or ``SLURM_NTASKS_PER_NODE``);
    None when no launcher says."""
    size = env_int("LOCAL_WORLD_SIZE")
    if size is not None:
        return size
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        if os.environ.get(name):
            tasks = slurm_tasks_on_this_node(os.environ[name], env_int("SLURM_NODEID"))
            if tasks is not None:
                return tasks
    return env_int("SLURM_NTASKS_PER_NODE")


def this_rank_cuda_index(device_count: int | None = None) -> int:
    """:func:`cuda_device_index` of this process, from the launcher's environment (the local rank of
    :func:`~mcpo_megatron.parallel.launcher.launcher_env`) and ``torch.cuda.device_count()``."""
    return cuda_device_index(launcher_env()[2], local_world_size_from_env(),
                             torch.cuda.device_count() if device_count is None else device_count,
                             os.environ.get(VISIBLE_DEVICES), torchrun="LOCAL_WORLD_SIZE" in os.environ)


def bind_this_rank() -> torch.device:
    """Make this rank's CUDA device (:func:`this_rank_cuda_index`) the current one and return it."""
    index = this_rank_cuda_index()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)
