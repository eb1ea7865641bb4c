"""The trainer leader's side of the weights with separate placement: which version the engines get, and the thread
that answers their asks (:class:`WeightPublisher`; the messages: ``rollout/remote_messages.py``).

The newest version is staged, so publishing never waits for the engines to finish a batch; it waits only until
the engines have taken the previous version for every batch that needs it, and while a version is still being sent
(the wait is reported as ``time/publish_wait``). With the reshard plan every trainer rank stages and sends its own
shards (``rollout/remote_plan.py``); for engines the plan does not cover, the leader stages the HF stream in host
buckets and broadcasts them.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

import torch

from mcpo_megatron.parallel.bridge import POLL_S, Bridge
from mcpo_megatron.rollout.remote_messages import InflightAsk, Offer, TensorMeta, pack_bucket
from mcpo_megatron.rollout.remote_plan import StagedShards


def staged_flag(version: int) -> str:
    """The store flag the trainer leader sets once ``version`` is staged (never cleared: versions only grow)."""
    return f"staged/{int(version)}"


class WeightPublisher:
    """The trainer leader's copy of the newest weights, and the thread that hands it to the engines.

    A :meth:`Resharder.push` target (``begin_update`` / ``update_weights`` / ``finish_update``): each push stages
    a new version in host memory (pinned on GPU machines). The thread answers the engines' asks (one per
    request, in request order) and broadcasts an offered version over the bridge (:meth:`_send_version`). A push
    waits until every request that needs the staged version has been answered (:meth:`expect` records what each
    request needs) and until the version being sent has left the host copy, so the version a request gets is
    exactly its ``min_version`` when the engines must update.

    On a GPU (``comm_device`` CUDA and an NCCL bridge) the thread's copies and broadcasts run on a CUDA stream of
    its own on the leader's GPU: on the default stream they would queue behind, and hold up, the training step's
    kernels for every version sent.
    """

    def __init__(self, bridge: Bridge, *, comm_device: torch.device | None = None, shards: StagedShards | None = None):
        self.bridge = bridge.clone()  # the thread's own store connection
        self.shards = shards               # the reshard plan: this rank's staged shards (None: HF buckets)
        self.comm_device = comm_device or torch.device("cpu")
        self.version = -1                  # the staged version (-1: none yet)
        self.first_version = -1            # the first staged version: the run's (or the resumed run's) start
        self.next_version = -1
        self.publish_wait_s = 0.0          # the last push's wait for the engines
        self._needs: list[int] = []        # per request (in order), its min_version
        self._answered = 0                 # asks answered so far
        self._posted = 0                   # offers posted so far
        self._buckets: list[tuple[list[TensorMeta], torch.Tensor]] = []
        self._staging: list[tuple[list[TensorMeta], torch.Tensor]] | None = None
        self._sending = False
        self._closing = False
        self._error: BaseException | None = None
        # The thread's own stream for the host-to-device copies and broadcasts (None: the host buffers go as they
        # are, over gloo).
        self._stream = (torch.cuda.Stream(device=self.comm_device)
                        if self.comm_device.type == "cuda" and self.bridge.nccl is not None else None)
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._serve, name="mcpo-weight-publisher", daemon=True)
        self._thread.start()

    def expect(self, min_version: int) -> None:
        """A request was submitted that needs weights of at least ``min_version``."""
        with self._cond:
            self._needs.append(int(min_version))

    def _target(self, need: int) -> int:
        """The version a request needing ``need`` gets: a batch submitted before the first publish, or needing an
        older version than the first, gets the first."""
        return max(need, self.first_version)

    def _still_needed(self) -> bool:
        """An unanswered request may need the staged version (so it must not be replaced yet)."""
        return any(self._target(need) <= self.version for need in self._needs[self._answered:])

    def _free(self) -> bool:
        """A push may stage a new version now (or must not wait: the thread failed, or closes)."""
        return self._error is not None or self._closing or not (self._sending or self._still_needed())

    @property
    def error(self) -> BaseException | None:
        return self._error

    def wait_until_free(self, check: Callable[[], None]) -> float:
        """Block until a push may stage a new version: the engines have taken the staged one for every request
        that needs it (they may first finish the batches queued ahead) and no version is being sent. Calls
        ``check()`` between looks, which raises when the engines failed; returns the seconds waited."""
        t0 = time.perf_counter()
        while True:
            with self._cond:
                if self._cond.wait_for(self._free, timeout=POLL_S):
                    return time.perf_counter() - t0
            check()

    def begin_staging(self) -> int:
        """Start staging a new version (after :meth:`wait_until_free`: at most a version being sent is waited for);
        returns how many offers were posted so far, which every trainer rank's sending thread must have finished
        with before its staging buffer is rewritten. No offer is made until :meth:`finish_update`."""
        t0 = time.perf_counter()
        with self._cond:
            self._cond.wait_for(self._free)
            self._staging = []
            posted = self._posted
        self.publish_wait_s = time.perf_counter() - t0
        if self._error is not None:
            raise RuntimeError(f"the weight publisher failed: {self._error!r}") from self._error
        return posted

    # Resharder.push target (HF buckets) ----------------------------------------------------------------------
    def begin_update(self) -> None:
        if self._staging is None:
            self.begin_staging()

    def update_weights(self, bucket) -> None:
        i = len(self._staging)
        reuse = self._buckets[i][1] if i < len(self._buckets) else None
        self._staging.append(pack_bucket(list(bucket), reuse, pin_memory=self.comm_device.type == "cuda"))

    def finish_update(self) -> None:
        with self._cond:
            self._buckets, self._staging = self._staging, None
            self.version = self.next_version
            if self.first_version < 0:
                self.first_version = self.version
            self._cond.notify_all()
        # the engines' cheap look between two segments (fast in-flight updates), once an ask would be answered
        self.bridge.set_flag(staged_flag(self.version))

    # the thread ----------------------------------------------------------------------------------------------
    def _serve(self) -> None:
        m = 0
        try:
            while True:
                ask = self.bridge.take(f"ask/{m}")
                if ask == "bye":
                    if self.shards is not None:  # the other trainer ranks' senders follow the offers: they stop
                        self.bridge.post(f"offer/{m}", Offer(None, shutdown=True))
                    return
                inflight = isinstance(ask, InflightAsk)
                t0 = time.perf_counter()
                with self._cond:
                    offer = self._inflight_offer(ask) if inflight else self._batch_offer(*ask)
                    offer.wait_s = time.perf_counter() - t0
                    self._sending = offer.version is not None
                    buckets = list(self._buckets)
                    self._posted += 1
                self.bridge.post(f"offer/{m}", offer)
                try:
                    if offer.version is not None:
                        if self.shards is not None:
                            self.shards.send()
                        else:
                            self._send_version([flat for _, flat in buckets])
                finally:
                    with self._cond:
                        self._sending = False
                        self._answered += not inflight  # in-flight asks belong to a batch already answered
                        self._cond.notify_all()
                    if self.shards is not None:
                        self.shards.processed()
                m += 1
        except BaseException as e:  # reported by the next push and by close()
            with self._cond:
                self._error = e
                self._cond.notify_all()

    def _batch_offer(self, have: int, need: int) -> Offer:
        """The answer to the ask before a batch (holding the lock): once a version >= ``need`` is staged, the
        staged version if the engines' is older than the batch allows, else nothing."""
        self._cond.wait_for(lambda: (self.version >= max(need, 0) and self._staging is None) or self._closing)
        if self._closing:  # no more batches will be taken: the engines skip the rest
            return Offer(None, shutdown=True)
        if have < self._target(need):
            return self._staged_offer()
        return Offer(None)  # the engines' weights are recent enough: they keep them

    def _inflight_offer(self, ask: InflightAsk) -> Offer:
        """The answer to an ask between two segments of a running batch (holding the lock). Repeatable
        (``block``): exactly version ``want``, once staged; it is the version of the batch's own step, which the
        trainer cannot replace before the batch is back. Otherwise what is staged now, if newer than the
        engines' (never newer than ``want``, for the same reason)."""
        if ask.block:
            self._cond.wait_for(lambda: (self.version >= ask.want and self._staging is None) or self._closing)
        if self._closing:
            return Offer(None, shutdown=True)
        if self._staging is not None or self.version <= ask.have:
            return Offer(None)
        if self.version > ask.want or (ask.block and self.version != ask.want):
            raise RuntimeError(f"the engines ask for version {ask.want} in flight but version {self.version} is "
                               "staged: the trainer published past a batch that is still running")
        return self._staged_offer()

    def _staged_offer(self) -> Offer:
        """An offer of the staged version: its buckets' tensor metadata and sizes (holding the lock)."""
        return Offer(self.version, [(metas, flat.numel()) for metas, flat in self._buckets])

    def _send_version(self, flats: list[torch.Tensor]) -> None:
        """Broadcast a version's buckets to the engine ranks, one bridge broadcast per bucket (every engine rank
        receives the same buckets in the same order, :meth:`RolloutServer._take_weights`).

        Without a side stream each broadcast gets the host buffer itself: a flat ``torch.uint8`` CPU tensor, over
        the bridge's gloo group. With one, each bucket is copied (asynchronously, from pinned memory) into a flat
        ``torch.uint8`` tensor on ``comm_device``, the leader's GPU, which goes over the bridge's NCCL group:
        copy and broadcast are issued on the side stream, so the broadcast (which NCCL orders after the work of
        the stream it is issued from) follows its copy, and the device buffer, allocated on that stream, is
        reused only after the broadcast (the bridge waits on its work, which makes the stream wait). The host
        buffers stay in use until every copy from them has completed (an event per copy, waited on here before
        the next push may rewrite them).
        """
        if self._stream is None:
            for flat in flats:
                self.bridge.broadcast(flat)
            return
        copied: list = []
        try:
            with torch.cuda.stream(self._stream):
                for flat in flats:
                    on_device = flat.to(self.comm_device, non_blocking=True)
                    done = torch.cuda.Event()
                    done.record(self._stream)
                    copied.append(done)
                    self.bridge.broadcast(on_device)
        finally:
            for done in copied:
                done.synchronize()

    def close(self, timeout_s: float = 600.0, check: Callable[[], None] | None = None) -> None:
        """Answer any pending ask with shutdown and wait for the engines' goodbye; ``check()`` between looks
        raises when the engines failed (then no goodbye will come)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        deadline = time.monotonic() + timeout_s
        while self._thread.is_alive() and time.monotonic() < deadline:
            self._thread.join(POLL_S)
            if check is not None:
                check()
        if self._error is not None:
            raise RuntimeError(f"the weight publisher failed: {self._error!r}") from self._error
