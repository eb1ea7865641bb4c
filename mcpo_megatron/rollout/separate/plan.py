"""The reshard plan with engines on ranks of their own (``rollout.placement=separate``): every trainer rank sends
its own shards, straight to the engine ranks that need them.

The plan (:mod:`~mcpo_megatron.rollout.weights.plan`) is compiled once, at start-up, over the bridge
(:func:`compile_remote_plan`: every trainer rank and every engine rank; layouts through the launch's store), with
the engine ranks as destinations and the trainer ranks as sources (engine replicas draw from different trainer
data-parallel replicas). Then, per version:

* each trainer rank **stages** its pieces (:meth:`StagedShards.stage`): packs every round's send buffer from its
  parameters into host memory (pinned on GPU machines, exactly its bytes; the copies asynchronous on a side stream,
  so training is not held up; the trainer's next update of its parameters waits for them:
  :meth:`StagedShards.before_training`);
* when the engines take the version, every trainer rank **sends** (:meth:`StagedShards.send`) and every engine rank
  receives, one bridge ``all_to_all`` per round; the engine writes the pieces into its weight target and finishes
  its update. A trainer rank sends on its main thread, at a fixed point of the step that every trainer rank reaches
  in the same order (the rule, and why: the module docstring of ``rollout/separate/remote.py``), after its own staging.

No rank gathers a whole tensor and nothing funnels through the trainer leader; the leader still decides, as
before, which version each batch gets (``rollout/separate/publisher.py``).
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from mcpo_megatron.parallel.bridge import ROLLOUT, Bridge
from mcpo_megatron.rollout.weights.transfer import PlanTransfer, byte_buffer


def compile_remote_plan(bridge: Bridge, *, model_chunks=None, target=None, bucket_bytes: int,
                        check: Callable[[], None] | None = None):
    """This rank's part of the plan over the bridge (a trainer rank passes its ``model_chunks``, an engine rank its
    engine's weight target, None when it has none), or None on every rank when some engine has no weight target
    (then the trainer leader streams HF buckets to the engines). Collective over the bridge, through its store;
    ``check()`` runs while waiting for the other ranks (the trainer leader's watch on the engines)."""
    from mcpo_megatron.rollout.weights.resharder import compile_for_group

    engine = bridge.roles.role == ROLLOUT
    layout = target.layout if target is not None else None
    calls = iter(range(1 << 30))

    def agree(x: int) -> int:
        return max(bridge.gather_objects(f"plan/agree/{next(calls)}", int(x), check))

    return compile_for_group(model_chunks, layout, has_engine=engine, rank=bridge.rank, bucket_bytes=bucket_bytes,
                             gather=lambda obj: bridge.gather_objects("plan/layouts", obj, check), agree=agree)


class StagedShards:
    """A trainer rank's pieces of the plan: staged per version, sent when the engines take it (see the module
    docstring). ``comm_device``: this rank's device (CUDA: staging in pinned host memory, sends over the bridge's
    NCCL group through a device buffer)."""

    def __init__(self, plan, sources: dict, bridge: Bridge, comm_device: torch.device):
        self.bridge = bridge
        self.cuda = comm_device.type == "cuda"
        self.transfer = PlanTransfer(plan, sources=sources, destinations=None, device=torch.device("cpu"),
                                     staged=True, pin_memory=self.cuda)
        self.comm_device = comm_device
        self._stream = torch.cuda.Stream(device=comm_device) if self.cuda else None
        self._staged_event = None
        self.version: int | None = None    # the version staged (None: none yet)
        # CUDA: each round goes from the pinned staging through a device buffer (NCCL sends device memory), taken
        # for the sends only
        self._device_send_bytes = plan.max_send_bytes
        self._no_recv = byte_buffer(0, comm_device if self.cuda else torch.device("cpu"))
        self.staged_bytes = 0

    def stage(self, version: int) -> tuple[int, float]:
        """Snapshot this rank's pieces of the current weights as ``version``; returns (bytes, seconds of the host's
        part). CUDA: the copies are issued on the side stream after the weights' last update on the current stream,
        and an event marks their end."""
        t0 = time.perf_counter()
        if self.cuda:
            self._stream.wait_stream(torch.cuda.current_stream(self.comm_device))  # the weights are final
            with torch.cuda.stream(self._stream):
                self.staged_bytes = self.transfer.stage()
                self._staged_event = torch.cuda.Event()
                self._staged_event.record(self._stream)
        else:
            self.staged_bytes = self.transfer.stage()
        self.version = int(version)
        return self.staged_bytes, time.perf_counter() - t0

    def before_training(self) -> None:
        """The trainer's next change of its parameters comes after the staging copies (CUDA: the current stream
        waits for them; the host does not)."""
        if self._staged_event is not None:
            torch.cuda.current_stream(self.comm_device).wait_event(self._staged_event)

    def send(self, version: int) -> None:
        """Every round of the staged ``version`` to the engine ranks: one bridge ``all_to_all`` per round, collective
        over every trainer and engine rank, on this rank's main thread at a fixed point (``rollout/separate/remote.py``).
        Refuses to send any other version than the one this rank staged last (the engines would hold a mix).

        Each round's send buffer is a flat ``torch.uint8`` tensor: on CUDA a slice of a buffer on ``comm_device``
        (this rank's GPU), over the bridge's NCCL group, copied there from the pinned staging on the side stream and
        exchanged from that stream (the receive buffer an empty ``torch.uint8`` tensor on the same GPU); without
        CUDA the CPU staging itself, over gloo. On CUDA every kernel issued before on the GPU has finished first
        (this rank's staging copies, and any training kernel or collective: the bridge's communicator is used in an
        epoch of its own), and the side stream has finished when it returns."""
        if self.version != version:
            staged = "nothing yet" if self.version is None else f"version {self.version}"
            raise RuntimeError(f"trainer rank {self.bridge.rank} was asked to send version {version} to the engines "
                               f"but has staged {staged}: every trainer rank sends the version it staged last, "
                               "so the trainer ranks and the engines disagree on which version is being taken")
        plan = self.transfer.plan
        device_send = None
        if self.cuda:
            torch.cuda.synchronize(self.comm_device)
            with torch.cuda.stream(self._stream):  # allocated on the stream that uses it
                device_send = byte_buffer(self._device_send_bytes, self.comm_device)
        for k in range(plan.num_rounds):
            staged, send_sizes = self.transfer.send_buffer(k)
            recv_sizes = [0] * plan.world
            if self.cuda:
                with torch.cuda.stream(self._stream):
                    send = device_send[:staged.numel()]
                    send.copy_(staged, non_blocking=True)
                    self.bridge.all_to_all(self._no_recv, send, recv_sizes, send_sizes)
            else:
                self.bridge.all_to_all(self._no_recv, staged, recv_sizes, send_sizes)
        if self.cuda:
            self._stream.synchronize()
