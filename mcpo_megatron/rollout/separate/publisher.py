"""The trainer leader's side of the weights with separate placement: which version each of the engines' asks gets
(:class:`WeightPublisher`; the messages: ``rollout/separate/messages.py``), and the HF buckets for engines the reshard
plan does not cover.

The newest version is staged, so publishing never waits for the engines to finish a batch; it waits only until
the engines have taken the staged version for every batch that needs it (the wait is reported as
``time/publish_wait``). With the reshard plan every trainer rank stages and sends its own shards
(``rollout/separate/plan.py``); for engines the plan does not cover, the leader stages the HF stream in host
buckets and broadcasts them.

The publisher has no thread: the leader's main thread answers the engines' asks at the fixed points of
:class:`~mcpo_megatron.rollout.separate.remote.RemoteRollouts` (the rule for the bridge's collectives, and why: the module
docstring of ``rollout/separate/remote.py``).
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from mcpo_megatron.parallel.bridge import POLL_S, Bridge
from mcpo_megatron.rollout.separate.messages import InflightAsk, Offer, TensorMeta, pack_bucket
from mcpo_megatron.rollout.separate.plan import StagedShards


def staged_flag(version: int) -> str:
    """The store flag the trainer leader sets once ``version`` is staged (never cleared: versions only grow)."""
    return f"staged/{int(version)}"


class WeightPublisher:
    """The trainer leader's staged version and its answers to the engines' asks.

    A :meth:`Resharder.push` target (``begin_update`` / ``update_weights`` / ``finish_update``) for the HF buckets:
    each push stages a new version in host memory (pinned, exactly its bytes, on GPU machines);
    :meth:`staged` makes a staged version (the buckets, or with the plan every trainer rank's shards) the one the
    asks get. :meth:`answer_asks` answers the engines' asks (one per request, in request order, and the in-flight
    asks between two segments), each once the staged version can answer it; :meth:`expect` records what each request
    needs and :meth:`needed` whether an unanswered request still needs the staged version, so the version a request
    gets is exactly its ``min_version`` when the engines must update.

    On a GPU (``comm_device`` CUDA and an NCCL bridge) the HF buckets are copied and broadcast on a CUDA stream of
    its own on the leader's GPU (:meth:`send_buckets`).
    """

    def __init__(self, bridge: Bridge, *, comm_device: torch.device | None = None, shards: StagedShards | None = None):
        self.bridge = bridge
        self.shards = shards               # the reshard plan: this rank's staged shards (None: HF buckets)
        self.comm_device = comm_device or torch.device("cpu")
        self.version = -1                  # the staged version (-1: none yet)
        self.first_version = -1            # the first staged version: the run's (or the resumed run's) start
        self._needs: list[int] = []        # per request (in order), its min_version
        self._asks = 0                     # asks taken from the store: the next one is ask/<_asks>
        self.asked = 0                     # requests the engines asked for: their next batch ask is for this one
        self._answered = 0                 # requests whose ask was answered
        self.held: object | None = None    # an ask taken that the staged version cannot answer yet
        self._buckets: list[tuple[list[TensorMeta], torch.Tensor]] = []
        self._staging: list[tuple[list[TensorMeta], torch.Tensor]] | None = None
        self._staging_error: BaseException | None = None
        self._closing = False
        self.goodbye = False               # the engines left their loop
        # The stream for the HF buckets' host-to-device copies and broadcasts (None: the host buffers go as they
        # are, over gloo).
        self._stream = (torch.cuda.Stream(device=self.comm_device)
                        if self.comm_device.type == "cuda" and bridge.nccl is not None else None)

    @property
    def asks(self) -> int:
        """Asks answered so far."""
        return self._asks

    @property
    def requests(self) -> int:
        """Requests submitted so far."""
        return len(self._needs)

    def expect(self, min_version: int) -> None:
        """A request was submitted that needs weights of at least ``min_version``."""
        self._needs.append(int(min_version))

    def _target(self, need: int) -> int:
        """The version a request needing ``need`` gets: a batch submitted before the first publish, or needing an
        older version than the first, gets the first."""
        return max(need, self.first_version)

    def needed(self) -> bool:
        """An unanswered request may need the staged version (so it must not be replaced yet)."""
        return not self._closing and any(self._target(need) <= self.version for need in self._needs[self._answered:])

    # Resharder.push target (HF buckets) ----------------------------------------------------------------------
    def begin_update(self) -> None:
        self._staging, self._staging_error = [], None

    def update_weights(self, bucket) -> None:
        # The push is collective over the trainer ranks (the others take part in its gathers): an error here must
        # not leave them in it, so it is kept and raised by staged(), where it reaches every trainer rank.
        if self._staging_error is not None:
            return
        i = len(self._staging)
        reuse = self._buckets[i][1] if i < len(self._buckets) else None
        try:
            self._staging.append(pack_bucket(list(bucket), reuse, pin_memory=self.comm_device.type == "cuda"))
        except Exception as e:  # noqa: BLE001 - raised by staged()
            self._staging_error = e

    def finish_update(self) -> None:
        if self._staging_error is None:
            self._buckets = self._staging
        self._staging = None

    def staged(self, version: int) -> None:
        """``version`` is staged (by the push, or with the plan by every trainer rank): the asks get it from now on;
        the engines' cheap look between two segments (fast in-flight updates) sees it."""
        if self._staging_error is not None:
            error, self._staging_error = self._staging_error, None
            raise RuntimeError(f"staging version {version} failed: {type(error).__name__}: {error}") from error
        self.version = int(version)
        if self.first_version < 0:
            self.first_version = self.version
        self.bridge.set_flag(staged_flag(self.version))

    # the engines' asks -----------------------------------------------------------------------------------------
    def answer_asks(self) -> Offer | None:
        """Take the engines' asks that have arrived, in order, and answer each that the staged version can answer;
        returns the first answer that offers a version, once posted (the trainer ranks then send it, before
        anything else is answered), or None when every ask there is has been answered or waits for a version."""
        while not self.goodbye:
            if self.held is None:
                key = f"ask/{self._asks}"
                if not self.bridge.ready(key):
                    return None
                self.held = self.bridge.take(key)
                if isinstance(self.held, tuple):
                    self.asked += 1
            ask = self.held
            if ask == "bye":
                self.goodbye = True
                return None
            offer = self._inflight_offer(ask) if isinstance(ask, InflightAsk) else self._batch_offer(*ask)
            if offer is None:
                return None
            self.bridge.post(f"offer/{self._asks}", offer)
            self._asks += 1
            self._answered += not isinstance(ask, InflightAsk)  # in-flight asks belong to a batch already answered
            self.held = None
            if offer.version is not None:
                return offer
        return None

    def _batch_offer(self, have: int, need: int) -> Offer | None:
        """The answer to the ask before a batch, once a version >= ``need`` is staged (None before): the staged
        version if the engines' is older than the batch allows, else nothing."""
        if self._closing:  # no more batches will be taken: the engines skip the rest
            return Offer(None, shutdown=True)
        if self.version < max(need, 0):
            return None
        if have < self._target(need):
            return self._staged_offer()
        return Offer(None)  # the engines' weights are recent enough: they keep them

    def _inflight_offer(self, ask: InflightAsk) -> Offer | None:
        """The answer to an ask between two segments of a running batch. Repeatable (``block``): exactly version
        ``want``, once staged (None before); it is the version of the batch's own step, which the trainer cannot
        replace before the batch is back. Otherwise what is staged now, if newer than the engines' (never newer
        than ``want``, for the same reason)."""
        if self._closing:
            return Offer(None, shutdown=True)
        if ask.block and self.version < ask.want:
            return None
        if self.version <= ask.have:
            return Offer(None)
        if self.version > ask.want or (ask.block and self.version != ask.want):
            raise RuntimeError(f"the engines ask for version {ask.want} in flight but version {self.version} is "
                               "staged: the trainer published past a batch that is still running")
        return self._staged_offer()

    def _staged_offer(self) -> Offer:
        """An offer of the staged version: its buckets' tensor metadata and sizes (none with the plan)."""
        return Offer(self.version, [(metas, flat.numel()) for metas, flat in self._buckets])

    def send_buckets(self) -> None:
        """Broadcast the staged version's HF buckets to the engine ranks, one bridge broadcast per bucket (every
        engine rank receives the same buckets in the same order, :meth:`RolloutServer._take_weights`); on the
        trainer leader's main thread, at a fixed point.

        Without a side stream each broadcast gets the host buffer itself: a flat ``torch.uint8`` CPU tensor, over
        the bridge's gloo group. With one, every kernel issued before on the leader's GPU has finished first (the
        bridge's NCCL communicator is used in an epoch of its own), then each bucket is copied (asynchronously,
        from pinned memory) into a flat ``torch.uint8`` tensor on ``comm_device``, the leader's GPU, which goes
        over the bridge's NCCL group: copy and broadcast are issued on the side stream, so the broadcast (which
        NCCL orders after the work of the stream it is issued from) follows its copy, and the device buffer,
        allocated on that stream, is reused only after the broadcast (the bridge waits on its work, which makes the
        stream wait). The host buffers stay in use until every copy from them has completed (an event per copy,
        waited on here, before the next push may rewrite them), and the side stream has finished before training
        goes on.
        """
        flats = [flat for _, flat in self._buckets]
        if self._stream is None:
            for flat in flats:
                self.bridge.broadcast(flat)
            return
        torch.cuda.synchronize(self.comm_device)
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
        self._stream.synchronize()

    def close(self, timeout_s: float = 600.0, check: Callable[[], None] | None = None) -> None:
        """Answer every ask with shutdown until the engines' goodbye (at most ``timeout_s``: then the launcher ends
        them); ``check()`` between looks raises when the engines failed (then no goodbye will come)."""
        self._closing = True
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.answer_asks()
            if self.goodbye:
                return
            if check is not None:
                check()
            time.sleep(POLL_S / 10)
