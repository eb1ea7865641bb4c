"""The reshard plan with engines on ranks of their own (``rollout.placement=separate``): every trainer rank sends
its own shards, straight to the engine ranks that need them.

The plan (:mod:`~mcpo_megatron.rollout.reshard_plan`) is compiled once, at start-up, over the bridge
(:func:`compile_remote_plan`: every trainer rank and every engine rank; layouts through the launch's store), with
the engine ranks as destinations and the trainer ranks as sources (engine replicas draw from different trainer
data-parallel replicas). Then, per version:

* each trainer rank **stages** its pieces (:meth:`StagedShards.stage`): packs every round's send buffer from its
  parameters into host memory (pinned on GPU machines, the copies asynchronous on a side stream, so training is
  not held up; the trainer's next update of its parameters waits for them: :meth:`StagedShards.before_training`);
* when the engines ask for the version, every trainer rank **sends** (:meth:`StagedShards.send`, on a thread: the
  trainer leader's publisher thread, :class:`OfferFollower` on the others) and every engine rank receives, one
  bridge ``all_to_all`` per round; the engine writes the pieces into its weight target and finishes its update.

No rank gathers a whole tensor and nothing funnels through the trainer leader; the leader still decides, as
before, which version each batch gets (``rollout/weight_publisher.py``).
"""

from __future__ import annotations

import threading
import time
from typing import Callable

import torch

from mcpo_megatron.parallel.bridge import ROLLOUT, Bridge
from mcpo_megatron.rollout.reshard_transfer import PlanTransfer, byte_buffer


def compile_remote_plan(bridge: Bridge, *, model_chunks=None, target=None, bucket_bytes: int,
                        check: Callable[[], None] | None = None):
    """This rank's part of the plan over the bridge (a trainer rank passes its ``model_chunks``, an engine rank its
    engine's weight target, None when it has none), or None on every rank when some engine has no weight target
    (then the trainer leader streams HF buckets to the engines). Collective over the bridge, through its store;
    ``check()`` runs while waiting for the other ranks (the trainer leader's watch on the engines)."""
    from mcpo_megatron.rollout.reshard import compile_for_group

    engine = bridge.roles.role == ROLLOUT
    layout = target.layout if target is not None else None
    calls = iter(range(1 << 30))

    def agree(x: int) -> int:
        return max(bridge.gather_objects(f"plan/agree/{next(calls)}", int(x), check))

    return compile_for_group(model_chunks, layout, has_engine=engine, rank=bridge.rank, bucket_bytes=bucket_bytes,
                             gather=lambda obj: bridge.gather_objects("plan/layouts", obj, check), agree=agree)


def offer_readers(roles, planned: bool) -> int:
    """How many ranks read each weight offer: the engine ranks, and with the plan the trainer ranks besides the
    leader (they send their shards)."""
    return roles.rollout_ranks + (roles.trainers - 1 if planned else 0)


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
        # CUDA: each round goes from the pinned staging through a device buffer (NCCL sends device memory), taken
        # for the sends only
        self._device_send_bytes = plan.max_send_bytes
        self._no_recv = byte_buffer(0, comm_device if self.cuda else torch.device("cpu"))
        self.sent = 0                      # offers with a version this rank has sent for
        self._cond = threading.Condition()
        self._processed = 0                # offers this rank's sending thread has finished with
        self.staged_bytes = 0

    # ------------------------------------------------------------------ the trainer's main thread
    def stage(self) -> tuple[int, float]:
        """Snapshot this rank's pieces of the current weights; returns (bytes, seconds of the host's part)."""
        t0 = time.perf_counter()
        if self.cuda:
            self._stream.wait_stream(torch.cuda.current_stream(self.comm_device))  # the weights are final
            with torch.cuda.stream(self._stream):
                self.staged_bytes = self.transfer.stage()
                self._staged_event = torch.cuda.Event()
                self._staged_event.record(self._stream)
        else:
            self.staged_bytes = self.transfer.stage()
        return self.staged_bytes, time.perf_counter() - t0

    def before_training(self) -> None:
        """The trainer's next change of its parameters comes after the staging copies (CUDA: the current stream
        waits for them; the host does not)."""
        if self._staged_event is not None:
            torch.cuda.current_stream(self.comm_device).wait_event(self._staged_event)

    def wait_processed(self, offers: int, check: Callable[[], None] | None = None) -> None:
        """Until this rank's sending thread has finished with the first ``offers`` offers (so the staging buffer
        may be rewritten)."""
        with self._cond:
            while self._processed < offers:
                self._cond.wait(timeout=0.1)
                if check is not None:
                    check()

    # ------------------------------------------------------------------ the sending thread
    def send(self) -> None:
        """Every round of the staged version to the engine ranks (collective over the bridge)."""
        if self._staged_event is not None:
            self._staged_event.synchronize()
        plan = self.transfer.plan
        device_send = None
        if self.cuda:
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
        self.sent += 1

    def processed(self) -> None:
        """One more offer finished with (sent for, or not needing a transfer)."""
        with self._cond:
            self._processed += 1
            self._cond.notify_all()


class OfferFollower:
    """On a trainer rank other than the leader: reads every weight offer in order and takes part in the transfer
    of each offered version (:meth:`StagedShards.send`), until the shutdown offer."""

    def __init__(self, bridge: Bridge, shards: StagedShards, readers: int):
        self.bridge, self.shards, self.readers = bridge.clone(), shards, readers
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._follow, name="mcpo-offer-follower", daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        m = 0
        try:
            while True:
                offer = self.bridge.read_shared(f"offer/{m}", self.readers)
                if offer.shutdown:
                    return
                if offer.version is not None:
                    self.shards.send()
                self.shards.processed()
                m += 1
        except BaseException as e:  # noqa: BLE001 - reported by the next publish
            self.error = e

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)
