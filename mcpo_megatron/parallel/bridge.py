"""Separate placement (``rollout.placement=separate``): two worlds in one launch, and the bridge between them.

A launch of N processes (torchrun, srun) gives the last ``rollout.ranks`` (R) of them to the rollout engines and the
first N - R to training. Each role starts a ``torch.distributed`` world of its own over the launch's rendezvous
store (:func:`start_role_world`): Megatron-core builds its TP/PP/DP groups over the trainer world exactly as it
does over a colocated one, and vLLM's ``external_launcher`` sees the engine world as its whole world (vLLM lays
out ``[-1, pp=1, tp]`` over it). Why two worlds and not one: both libraries take the default group to be theirs
(Megatron's ``initialize_model_parallel`` and vLLM's external launcher span every rank of it), and neither can be
told to use a part of it. Inside each world nothing changes.

The :class:`Bridge` joins every trainer rank (bridge ranks 0..T-1; rank 0 is "the trainer leader") and every
engine rank (bridge ranks T..T+R-1):

* messages (requests, results, weight offers) are pickled into the launch's store under keys of their own. A
  message is written once and read when its reader gets to it, so neither side waits for the other to be ready
  (the engines generate the next batch while the trainer trains), and a reader polls with a short timeout, so
  a preemption signal is handled within a second. Large messages are cut into chunks of ``CHUNK_BYTES``. The
  trainer leader and the engine leader talk; the other trainer ranks only read the weight offers.
* weights go over process groups of the bridge ranks (gloo; NCCL for CUDA tensors on GPU machines), after both
  sides agreed through the store that an update comes (``rollout/separate/messages.py``): with the reshard plan,
  every trainer rank sends its own shards to the engine ranks that need them, one ``all_to_all`` of the whole
  bridge per round (:meth:`Bridge.all_to_all`); for engines the plan does not cover, the trainer leader
  broadcasts HF buckets to the engine ranks over a group of those alone (:meth:`Bridge.broadcast`).

The store is the launcher's: torchrun's agent store, or, under srun, the TCP store global rank 0 serves.
"""

from __future__ import annotations

import copy
import os
import pickle
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

TRAIN, ROLLOUT = "train", "rollout"
CHUNK_BYTES = 256 * 2**20  # a store value is held whole in the server's memory: keep each piece bounded
POLL_S = 0.1               # the longest pause between two looks at the store while waiting for a message


class Stopped(Exception):
    """A wait on the bridge ended because ``should_stop`` said so."""


@dataclass(frozen=True)
class Roles:
    """Where a process sits in a launch with separate placement."""

    role: str          # TRAIN | ROLLOUT
    rank: int          # in its role's world
    size: int          # of its role's world
    global_rank: int
    global_size: int
    rollout_ranks: int

    @property
    def trainers(self) -> int:
        return self.global_size - self.rollout_ranks

    @property
    def bridge_rank(self) -> int:
        """Trainer rank t is bridge rank t (0: the trainer leader), engine rank e is bridge rank T + e."""
        return self.rank if self.role == TRAIN else self.trainers + self.rank

    @property
    def bridge_size(self) -> int:
        return self.global_size

    @property
    def broadcast_rank(self) -> int | None:
        """The rank in the leader-to-engines group: 0 for the trainer leader, 1 + e for engine rank e, None for the
        other trainer ranks."""
        if self.role == ROLLOUT:
            return 1 + self.rank
        return 0 if self.rank == 0 else None


def split_roles(global_rank: int, global_size: int, rollout_ranks: int) -> Roles:
    """The last ``rollout_ranks`` ranks of the launch run engines, the others train (so on SLURM, where ranks
    fill nodes in order, the last nodes are the engines')."""
    if not 1 <= rollout_ranks < global_size:
        raise ValueError(f"rollout.ranks={rollout_ranks} must be >= 1 and leave ranks to train: the launch has "
                         f"{global_size} ranks")
    trainers = global_size - rollout_ranks
    if global_rank < trainers:
        return Roles(TRAIN, global_rank, trainers, global_rank, global_size, rollout_ranks)
    return Roles(ROLLOUT, global_rank - trainers, rollout_ranks, global_rank, global_size, rollout_ranks)


def launch_store(global_rank: int, global_size: int, timeout_s: float):
    """The launch's rendezvous store (torch's ``env://`` rendezvous: torchrun's agent store, or a TCP store that
    global rank 0 serves at MASTER_ADDR:MASTER_PORT)."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    store, _, _ = next(dist.rendezvous("env://", rank=global_rank, world_size=global_size,
                                       timeout=timedelta(seconds=timeout_s)))
    return store


def start_role_world(roles: Roles, backend: str, timeout_s: float) -> "Bridge":
    """Start this process's role world as the default ``torch.distributed`` group, and the bridge.

    Afterwards ``RANK`` / ``WORLD_SIZE`` (and ``SLURM_PROCID`` / ``SLURM_NTASKS``) name the rank in the role's
    world, so every later reader (Megatron, vLLM's external launcher, the trainer's rank-0 duties) sees the role
    world as the world; the launch's are kept in ``MCPO_GLOBAL_RANK`` / ``MCPO_GLOBAL_WORLD_SIZE``.
    """
    store = launch_store(roles.global_rank, roles.global_size, timeout_s)
    os.environ["MCPO_GLOBAL_RANK"], os.environ["MCPO_GLOBAL_WORLD_SIZE"] = str(roles.global_rank), str(roles.global_size)
    os.environ["MCPO_ROLE"] = roles.role
    for rank_var, size_var in (("RANK", "WORLD_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS")):
        if rank_var in os.environ or rank_var == "RANK":
            os.environ[rank_var], os.environ[size_var] = str(roles.rank), str(roles.size)
    dist.init_process_group(backend=backend, store=dist.PrefixStore(f"mcpo/{roles.role}", store), rank=roles.rank,
                            world_size=roles.size, timeout=timedelta(seconds=timeout_s))
    return Bridge(store, roles, timeout_s=timeout_s)


class Bridge:
    """Messages and weights between the trainer ranks and the engine ranks (see the module docstring)."""

    def __init__(self, store, roles: Roles, *, timeout_s: float = 1800.0):
        self.roles = roles
        self.rank, self.size = roles.bridge_rank, roles.bridge_size
        self.store = dist.PrefixStore("mcpo/bridge/msg", store)
        timeout = timedelta(seconds=timeout_s)
        cuda = torch.cuda.is_available()
        # Every rank: the reshard plan's exchanges (CUDA tensors over NCCL, CPU tensors over gloo).
        self.all_gloo = dist.ProcessGroupGloo(dist.PrefixStore("mcpo/bridge/all/gloo", store), self.rank, self.size,
                                              timeout)
        self.all_nccl = (dist.ProcessGroupNCCL(dist.PrefixStore("mcpo/bridge/all/nccl", store), self.rank, self.size)
                         if cuda else None)
        # The trainer leader and the engine ranks: HF buckets for engines the plan does not cover.
        self.gloo = self.nccl = None
        b = roles.broadcast_rank
        if b is not None:
            n = 1 + roles.rollout_ranks
            self.gloo = dist.ProcessGroupGloo(dist.PrefixStore("mcpo/bridge/gloo", store), b, n, timeout)
            if cuda:
                self.nccl = dist.ProcessGroupNCCL(dist.PrefixStore("mcpo/bridge/nccl", store), b, n)

    def clone(self) -> "Bridge":
        """The same bridge over a connection of its own to the store, for another thread."""
        other = copy.copy(self)
        other.store = self.store.clone()
        return other

    # ------------------------------------------------------------------ messages
    def post(self, key: str, obj: Any) -> None:
        """Write ``obj`` under ``key`` (pieces first, then the count that makes it visible)."""
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        pieces = max(1, -(-len(data) // CHUNK_BYTES))
        for i in range(pieces):
            self.store.set(f"{key}/{i}", data[i * CHUNK_BYTES:(i + 1) * CHUNK_BYTES])
        self.store.set(f"{key}/n", str(pieces))

    def ready(self, key: str) -> bool:
        return self.store.check([f"{key}/n"])

    def wait(self, key: str, should_stop: Callable[[], bool] | None = None,
             check: Callable[[], None] | None = None) -> None:
        """Block until ``key`` was posted; raise :class:`Stopped` when ``should_stop()`` turns true first, and
        whatever ``check()`` raises (the trainer leader's watch on the engines, ``rollout/separate/liveness.py``).

        Polls (a store wait that times out logs a warning each time): every millisecond at first, backing off to
        every ``POLL_S`` seconds, so a quick answer is seen at once and a long wait costs little.
        """
        pause = 1e-3
        while not self.ready(key):
            if should_stop is not None and should_stop():
                raise Stopped(key)
            if check is not None:
                check()
            time.sleep(pause)
            pause = min(pause * 2, POLL_S)

    def read(self, key: str, should_stop: Callable[[], bool] | None = None,
             check: Callable[[], None] | None = None) -> Any:
        """The object posted under ``key`` (waiting for it); the key stays."""
        self.wait(key, should_stop, check)
        pieces = int(self.store.get(f"{key}/n"))
        return pickle.loads(b"".join(self.store.get(f"{key}/{i}") for i in range(pieces)))

    def delete(self, key: str) -> None:
        pieces = int(self.store.get(f"{key}/n"))
        self.store.delete_key(f"{key}/n")
        for i in range(pieces):
            self.store.delete_key(f"{key}/{i}")

    def take(self, key: str, should_stop: Callable[[], bool] | None = None,
             check: Callable[[], None] | None = None) -> Any:
        """Read the object under ``key`` and remove it (for a key with one reader)."""
        obj = self.read(key, should_stop, check)
        self.delete(key)
        return obj

    def read_shared(self, key: str, readers: int, should_stop: Callable[[], bool] | None = None) -> Any:
        """Read the object under ``key``, which ``readers`` ranks read each once; the last of them removes it."""
        obj = self.read(key, should_stop)
        if self.store.add(f"{key}/read", 1) == readers:
            self.delete(key)
            self.store.delete_key(f"{key}/read")
        return obj

    def gather_objects(self, tag: str, obj: Any, check: Callable[[], None] | None = None) -> list[Any]:
        """Every bridge rank's ``obj``, in bridge-rank order, through the store (small objects: a plan's
        layouts); every rank calls it once per ``tag``. ``check()`` runs between looks (it raises to give up)."""
        self.post(f"gather/{tag}/{self.rank}", obj)
        return [self.read(f"gather/{tag}/{r}", check=check) for r in range(self.size)]
    def set_flag(self, name: str) -> None:
        self.store.set(f"flag/{name}", b"1")

    def flag(self, name: str) -> bool:
        return self.store.check([f"flag/{name}"])

    # ------------------------------------------------------------------ weights
    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """In-place broadcast of ``tensor`` from the trainer leader to every engine rank: over NCCL for a CUDA
        tensor, over gloo for a CPU one. The tensors are weight buckets, flat ``torch.uint8`` (see
        ``rollout/separate/messages.py``): on the leader its GPU copy (issued on the publisher's side stream) or its host
        buffer, on an engine rank a buffer on that rank's device.

        Waits on the collective's work: for gloo until it completed; for NCCL the current CUDA stream waits for
        it, so work issued afterwards on that stream (the engine's reads of the buffer, the reuse of the sender's
        device buffer) comes after the broadcast.
        """
        group = self.nccl if tensor.is_cuda else self.gloo
        if group is None:
            raise RuntimeError(f"the bridge has no backend for {tensor.device} tensors on this rank")
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        group.broadcast([tensor], opts).wait()
        return tensor

    def all_to_all(self, recv: torch.Tensor, send: torch.Tensor, recv_sizes: list[int],
                   send_sizes: list[int]) -> None:
        """One round of the reshard plan over every bridge rank: ``send_sizes[i]`` bytes of the flat
        ``torch.uint8`` ``send`` go to bridge rank ``i``, ``recv_sizes[i]`` bytes from it land in ``recv``. Over NCCL
        for CUDA buffers (both on this rank's GPU: the current stream waits for the exchange), else gloo (returns
        when it completed)."""
        group = self.all_nccl if send.is_cuda else self.all_gloo
        if group is None:
            raise RuntimeError(f"the bridge has no backend for {send.device} tensors")
        group.alltoall_base(recv, send, list(recv_sizes), list(send_sizes), dist.AllToAllOptions()).wait()
