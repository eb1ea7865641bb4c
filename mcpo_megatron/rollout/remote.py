"""Rollout engines on ranks of their own (``rollout.placement=separate``): the trainer's side
(:class:`RemoteRollouts`), the engines' side (:class:`RolloutServer`), and the weights between them
(:class:`WeightPublisher`). Transport: :class:`~mcpo_megatron.parallel.bridge.Bridge`.

Protocol (keys in the launch's store; ``n`` counts requests, ``m`` weight asks):

* ``req/n``: the trainer leader submits a generation batch (:class:`GenerateRequest`: prompts, sampling,
  ``min_version``) or :class:`Shutdown`. Every engine rank reads every request, so the engine world works in
  lockstep; requests are served in order.
* before each batch the engine leader asks for weights, ``ask/m`` = (version it holds, ``min_version``); the
  trainer leader's publisher answers ``offer/m`` as soon as it has staged a version >= ``min_version``: the
  newest version if it is newer than the engines', else nothing. An offered version is then broadcast, bucket by
  bucket, from the trainer leader's host copy to every engine rank, and loaded through the engine's weight
  update (for vLLM, its weight-transfer lifecycle: ``rollout/vllm_transfer.py``).
* ``res/n``: the engine leader's :class:`GenerateResult`: the samples, the policy version that generated them, and
  the engines' timings (generation, idle, weight waits and transfers).
* ``hb/<bridge rank>``: each engine rank's heartbeat, with the batch it works on and for how long. Every wait of
  the trainer leader on the engines watches them, so a silent engine rank, a batch over
  ``rollout.batch_timeout_s``, or a wait longer than the batches queued may take ends in an error that every
  trainer rank raises (``rollout/liveness.py``).

Staleness (spec section 8). A batch for global step s is submitted with ``min_version = s - max_staleness``; an
engine keeps its weights when they are at least that recent, else loads exactly that version (or the first one
published, after a resume). So a trained sample's staleness never exceeds ``max_staleness``, and which version a
batch gets never depends on timing: a run repeats exactly, at any staleness. The price: with
``max_staleness`` >= 2 the engines use weights that old even when newer ones exist (they buffer up to that many
batches ahead, which absorbs uneven generation times, but do not make the samples fresher).

The trainer leader keeps one host copy of the newest weights, so publishing never waits for the engines to finish
a batch; it waits only until the engines have taken the previous version for every batch that needs it, and while
a version is still being sent (the wait is reported as ``time/publish_wait``).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from mcpo_megatron.parallel.bridge import POLL_S, Bridge, Stopped
from mcpo_megatron.parallel.distributed import barrier, broadcast_object, new_gloo_group
from mcpo_megatron.rollout.engine import (
    GenerationInterrupted,
    RolloutOutput,
    SamplingParams,
    StopPoll,
    generate_data_parallel,
)
from mcpo_megatron.rollout.liveness import EnginesFailed, EngineWatch, Heartbeat, Waits, engine_names
from mcpo_megatron.rollout.placement import GeneratedBatch, WeightUpdate

ALIGN = 64           # byte offset of each tensor in a packed bucket (any dtype's view of the flat buffer is aligned)
STOP_FLAG = "stop"   # set by the trainer: engines abandon the batch they are generating
FLAG_POLL_S = 0.2    # how often a generating engine looks at the stop flag (a store round trip)


@dataclass
class GenerateRequest:
    key: Any
    prompts: list[list[int]]
    sampling: SamplingParams
    first_index: int = 0
    min_version: int = 0


@dataclass
class Shutdown:
    """The last request: the engines leave their loop."""


@dataclass
class GenerateResult:
    key: Any
    output: RolloutOutput | None       # None: generation was interrupted
    version: int
    generate_s: float = 0.0
    idle_s: float = 0.0
    updates: list[WeightUpdate] = field(default_factory=list)
    error: str | None = None           # an exception on the engine ranks (they exit after reporting it)


@dataclass
class TensorMeta:
    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    nbytes: int


@dataclass
class Offer:
    """The publisher's answer to an ask: a version to load (with the bucket layout), none newer, or shutdown."""

    version: int | None
    buckets: list[tuple[list[TensorMeta], int]] = field(default_factory=list)  # (tensors, bucket bytes)
    wait_s: float = 0.0
    shutdown: bool = False

    @property
    def bytes(self) -> int:
        return sum(meta.nbytes for metas, _ in self.buckets for meta in metas)


# --------------------------------------------------------------------------- packing
def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


def pack_bucket(bucket: Sequence[tuple[str, torch.Tensor]], out: torch.Tensor | None = None, *,
                pin_memory: bool = False) -> tuple[list[TensorMeta], torch.Tensor]:
    """A reshard bucket as one flat host byte buffer (``out`` reused when its size fits) and its layout."""
    metas, offset = [], 0
    for name, t in bucket:
        nbytes = t.numel() * t.element_size()
        metas.append(TensorMeta(name, tuple(t.shape), str(t.dtype), offset, nbytes))
        offset += -(-nbytes // ALIGN) * ALIGN
    if out is None or out.numel() != offset:
        out = torch.empty(offset, dtype=torch.uint8, pin_memory=pin_memory)
    for meta, (_, t) in zip(metas, bucket):
        out[meta.offset:meta.offset + meta.nbytes].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
    return metas, out


def unpack_bucket(metas: Sequence[TensorMeta], flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Views of ``flat`` as the bucket's named tensors."""
    return [(m.name, flat[m.offset:m.offset + m.nbytes].view(_dtype(m.dtype)).view(m.shape)) for m in metas]


# --------------------------------------------------------------------------- trainer side
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

    def __init__(self, bridge: Bridge, *, comm_device: torch.device | None = None):
        self.bridge = bridge.clone()  # the thread's own store connection
        self.comm_device = comm_device or torch.device("cpu")
        self.version = -1                  # the staged version (-1: none yet)
        self.first_version = -1            # the first staged version: the run's (or the resumed run's) start
        self.next_version = -1
        self.publish_wait_s = 0.0          # the last push's wait for the engines
        self._needs: list[int] = []        # per request (in order), its min_version
        self._answered = 0                 # asks answered so far
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

    # Resharder.push target ------------------------------------------------------------------------------------
    def begin_update(self) -> None:
        t0 = time.perf_counter()
        with self._cond:
            self._cond.wait_for(self._free)  # after wait_until_free: at most a version being sent
            self._staging = []
        self.publish_wait_s = time.perf_counter() - t0
        if self._error is not None:
            raise RuntimeError(f"the weight publisher failed: {self._error!r}") from self._error

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

    # the thread ----------------------------------------------------------------------------------------------
    def _serve(self) -> None:
        m = 0
        try:
            while True:
                ask = self.bridge.take(f"ask/{m}")
                if ask == "bye":
                    return
                have, need = ask
                t0 = time.perf_counter()
                with self._cond:
                    self._cond.wait_for(lambda: (self.version >= max(need, 0) and self._staging is None)
                                        or self._closing)
                    wait_s = time.perf_counter() - t0
                    if self._closing:  # no more batches will be taken: the engines skip the rest
                        offer = Offer(None, wait_s=wait_s, shutdown=True)
                    elif have < self._target(need):
                        offer = Offer(self.version, [(metas, flat.numel()) for metas, flat in self._buckets],
                                      wait_s=wait_s)
                        self._sending = True
                    else:  # the engines' weights are recent enough: they keep them
                        offer = Offer(None, wait_s=wait_s)
                    buckets = list(self._buckets)
                self.bridge.post(f"offer/{m}", offer)
                try:
                    if offer.version is not None:
                        self._send_version([flat for _, flat in buckets])
                finally:
                    with self._cond:
                        self._sending = False
                        self._answered += 1
                        self._cond.notify_all()
                m += 1
        except BaseException as e:  # reported by the next push and by close()
            with self._cond:
                self._error = e
                self._cond.notify_all()

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


class _Discard:
    """The push target of the trainer ranks other than the leader: they take part in the reshard's gathers only."""

    def begin_update(self) -> None:
        pass

    def update_weights(self, bucket) -> None:
        pass

    def finish_update(self) -> None:
        pass


def _routing_stays_with_the_leader(res: GenerateResult) -> tuple[GenerateResult, RolloutOutput]:
    """R3: the engines' routing (the largest part of a sample) is not broadcast to every trainer rank. The leader
    keeps it and the others learn it is there (``routing_rank`` 0), so each fetches only the samples it trains
    (``trainer.step_data.fetch_routing``), as with colocated engines. Returns (what is shared, what the leader
    keeps)."""
    kept = RolloutOutput([dataclasses.replace(x, routing_rank=0) for x in res.output.samples])
    shared = RolloutOutput([dataclasses.replace(x, routed_experts=None, routing_rank=0) for x in res.output.samples])
    return dataclasses.replace(res, output=shared), kept


class RemoteRollouts:
    """The trainer's handle on the engine ranks (every trainer rank holds one; the leader, trainer rank 0, talks
    to the engines and shares each result with the others). Same interface as
    :class:`~mcpo_megatron.rollout.placement.LocalRollouts`.

    While the leader waits on the engines (for a result, or before staging a version) it watches their
    heartbeats (:class:`~mcpo_megatron.rollout.liveness.EngineWatch`) within the limits of ``waits``; the other
    trainer ranks wait for it in one broadcast over a gloo group of the trainer ranks whose timeout is
    ``waits.trainer_group_s`` (:meth:`_share`), and raise the leader's error when it sends one. Each trainer rank
    makes the same collective calls: one broadcast per :meth:`result` and one per :meth:`publish`. Creating it is
    collective over the trainer ranks (the group). ``engine_ranks``: how many ranks the engines run on.
    """

    generation_time_key = "time/engine_generate"  # the engines' own generation seconds (generation_metrics)

    def __init__(self, bridge: Bridge | None, *, engine_ranks: int, waits: Waits,
                 comm_device: torch.device | None = None):
        if engine_ranks < 1:
            raise ValueError(f"RemoteRollouts: engine_ranks={engine_ranks} must be >= 1 (the engines' own ranks)")
        self.engine_ranks = int(engine_ranks)
        self.bridge = bridge
        self.leader = bridge is not None
        self.wait_group = new_gloo_group(waits.trainer_group_s)
        self.publisher = WeightPublisher(bridge, comm_device=comm_device) if self.leader else None
        self.watch = EngineWatch(bridge.store, engine_names(bridge.roles), waits) if self.leader else None
        self.failed = False               # the leader declared the engines failed: close() waits for nothing
        self.version = -1
        self.wait_s = 0.0                 # the trainer's wait for the last result
        self._gate_wait_s = 0.0           # the last publish's wait for the engines to take the staged version
        self._next = 0
        self._requests: dict[Any, int] = {}

    def submit(self, key, prompts: list[list[int]], sampling: SamplingParams, *, first_index: int = 0,
               min_version: int = 0) -> None:
        if key in self._requests:
            raise ValueError(f"generation batch {key!r} was already submitted")
        n, self._next = self._next, self._next + 1
        self._requests[key] = n
        if self.leader:
            self.publisher.expect(min_version)
            self.bridge.post(f"req/{n}", GenerateRequest(key, [list(p) for p in prompts], sampling, first_index,
                                                         min_version))

    def _watching(self, what: str) -> Callable[[], None]:
        """The leader's check while it waits for ``what``: raises :class:`EnginesFailed` when an engine rank is
        silent or over the batch limit, the weight publisher failed, or this wait outlasted ``waits.leader_s``."""
        since = self.watch.clock()

        def check() -> None:
            if self.publisher.error is not None:
                raise EnginesFailed(f"sending weights to the engine ranks failed while the trainer waited for "
                                    f"{what}: {self.publisher.error!r}")
            self.watch.check(what, since)
        return check

    def _share(self, obj: Any) -> Any:
        """The leader's ``obj`` on every trainer rank: a broadcast over the wait group (the object pickled into a
        CPU ``torch.uint8`` tensor after a CPU ``torch.int64`` size, over gloo, with CUDA too), in which the other
        trainer ranks wait while the leader waits on the engines."""
        return broadcast_object(obj, src=0, group=self.wait_group)

    def result(self, key, *, should_stop: StopPoll | None = None) -> GeneratedBatch:
        """Wait for the batch submitted under ``key``; collective over the trainer ranks. Raises
        :class:`GenerationInterrupted` when the leader's ``should_stop`` turned true first (or the engines were
        interrupted), and RuntimeError on every trainer rank when the engines failed (an error they reported,
        or the leader's watch: a silent engine rank, a batch or wait over its limit)."""
        n = self._requests.pop(key)
        res = kept = None
        t0 = time.perf_counter()
        if self.leader:
            try:
                res = self.bridge.take(f"res/{n}", should_stop, check=self._watching(f"generation batch {key!r}"))
            except Stopped:
                res = None
            except EnginesFailed as e:
                self.failed = True
                res = GenerateResult(key, None, self.version, error=str(e))
            if res is not None and res.output is not None and res.output.routed_experts is not None:
                res, kept = _routing_stays_with_the_leader(res)
        res = self._share(res)
        if kept is not None:
            res.output = kept
        self.wait_s = time.perf_counter() - t0
        if res is not None and res.error:
            raise RuntimeError(f"the rollout ranks failed on generation batch {key!r}: {res.error}")
        if res is None or res.output is None:
            raise GenerationInterrupted(f"generation batch {key!r} was interrupted")
        return GeneratedBatch(res.output, res.version, generate_s=res.generate_s, idle_s=res.idle_s,
                              updates=res.updates)

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, *, first_index: int = 0,
                 should_stop: StopPoll | None = None) -> RolloutOutput:
        """Generate now with the newest published weights (evaluation, probes)."""
        key = ("now", self._next)
        self.submit(key, [list(p) for p in prompts], sampling, first_index=first_index, min_version=self.version)
        return self.result(key, should_stop=should_stop).output

    def publish(self, resharder, version: int):
        """Stage the trainer's weights as ``version`` for the engines (collective over the trainer ranks: the
        reshard gathers); the engines load it before their next batch.

        First the leader waits, watching the engines, until they have taken the staged version for every batch
        that needs it; the other trainer ranks wait for its verdict (:meth:`_share`) rather than in the reshard's
        gathers, so an engine failure reaches them as the leader's error."""
        error = None
        if self.leader:
            self.publisher.next_version = int(version)
            try:
                self._gate_wait_s = self.publisher.wait_until_free(
                    self._watching(f"the engines to take version {self.version} before version {version} is staged"))
            except EnginesFailed as e:
                self.failed, error = True, str(e)
        error = self._share(error)
        if error is not None:
            raise RuntimeError(f"the rollout ranks failed before version {version} could be published: {error}")
        stats = resharder.push(self.publisher if self.leader else _Discard())
        self.version = int(version)
        return stats

    @property
    def publish_wait_s(self) -> float:
        return self._gate_wait_s + self.publisher.publish_wait_s if self.leader else 0.0

    def generation_metrics(self, batches: Sequence[GeneratedBatch]) -> dict[str, Any]:
        """Where the engines' time went over ``batches`` and how the weights travelled (GB/s over the engines'
        receive time), with the last publish's wait for the engines."""
        updates = [u for b in batches for u in b.updates]
        seconds, nbytes = sum(u.transfer_s for u in updates), sum(u.bytes for u in updates)
        return {"time/engine_generate": sum(b.generate_s for b in batches),
                "time/engine_idle": sum(b.idle_s for b in batches),
                "time/engine_weight_wait": sum(u.wait_s for u in updates),
                "time/publish_wait": self.publish_wait_s,
                "async/weight_updates": len(updates), "async/weight_bytes": nbytes,
                "reshard/transfer_s": seconds, "reshard/transfer_gbps": nbytes / seconds / 1e9 if seconds else 0.0}

    def after_rollouts(self) -> None:
        """The engines have GPUs of their own: nothing to free."""

    @property
    def in_flight(self) -> list:
        return list(self._requests)

    def close(self) -> None:
        """Stop the engines: abandon what they generate, end their loop, wait for their goodbye (none after the
        engines were declared failed, or once they fall silent: the launcher ends them)."""
        if not self.leader:
            return
        self.bridge.set_flag(STOP_FLAG)
        self.bridge.post(f"req/{self._next}", Shutdown())
        self._next += 1
        if not self.failed:
            self.publisher.close(check=lambda: self.watch.check("the engines' goodbye"))


# --------------------------------------------------------------------------- engine side
class RolloutServer:
    """The engine ranks' loop: read each request, take the newest weights, generate, report.

    Every engine rank runs it (lockstep over the engine world: the replicas split each batch,
    :func:`generate_data_parallel`); the engine world's rank 0 (the engine leader) writes the asks and results.
    ``should_stop`` is this rank's own stop signal (a preemption); the trainer's stop flag is checked too.
    """

    def __init__(self, bridge: Bridge, engine, *, rank: int, rollout_tp: int = 1, device: torch.device | None = None,
                 should_stop: StopPoll | None = None, heartbeat: Heartbeat | None = None, log=print):
        self.bridge, self.engine = bridge, engine
        self.heartbeat = heartbeat  # told which batch this rank works on (from its weight update to its report)
        self.leader = rank == 0
        self.rollout_tp = int(rollout_tp)
        self.device = device or torch.device("cpu")
        self.local_stop = should_stop
        self.log = log
        self.version = -1
        self._flag_checked, self._stopped = 0.0, False

    def should_stop(self) -> bool:
        if self._stopped or (self.local_stop is not None and self.local_stop()):
            return True
        now = time.monotonic()
        if now - self._flag_checked > FLAG_POLL_S:
            self._flag_checked = now
            self._stopped = self.bridge.flag(STOP_FLAG)
        return self._stopped

    def serve(self) -> int:
        """Serve requests until :class:`Shutdown`; returns how many batches were generated."""
        n = m = served = 0
        while True:
            t0 = time.perf_counter()
            req = self.bridge.read(f"req/{n}")
            barrier()  # every engine rank has read it
            if self.leader:
                self.bridge.delete(f"req/{n}")
            idle_s = time.perf_counter() - t0
            if isinstance(req, Shutdown):
                if self.leader:
                    self.bridge.post(f"ask/{m}", "bye")
                return served
            try:
                updates, m = self._take_weights(req.min_version, m, batch=req.key)
                if updates is None:  # the trainer is shutting down
                    self._report(n, GenerateResult(req.key, None, self.version, idle_s=idle_s))
                    n += 1
                    continue
                t1 = time.perf_counter()
                try:
                    out = generate_data_parallel(self.engine, req.prompts, req.sampling, rollout_tp=self.rollout_tp,
                                                 first_index=req.first_index, should_stop=self.should_stop)
                except GenerationInterrupted:
                    out = None
                self._report(n, GenerateResult(req.key, out, self.version, generate_s=time.perf_counter() - t1,
                                               idle_s=idle_s, updates=updates))
                served += out is not None
            except Exception as e:
                self._report(n, GenerateResult(req.key, None, self.version, error=f"{type(e).__name__}: {e}"))
                raise
            finally:
                if self.heartbeat is not None:
                    self.heartbeat.idle()
            n += 1

    def _report(self, n: int, result: GenerateResult) -> None:
        if self.leader:
            self.bridge.post(f"res/{n}", result)

    def _take_weights(self, min_version: int, m: int, *, batch) -> tuple[list[WeightUpdate] | None, int]:
        """Ask for the newest weights (at least ``min_version``) and load them if they are newer than ours. Once
        the offer is in (waiting for it can last as long as the trainer trains), this rank works on ``batch``.

        Each bucket arrives by a bridge broadcast into a flat ``torch.uint8`` tensor on this rank's device (its
        GPU over NCCL, or the CPU over gloo). The engine reads it on this thread's current stream, which the
        bridge made wait for the broadcast (:meth:`Bridge.broadcast` waits on the collective's work), so no read
        comes before the bytes have arrived.
        """
        if self.leader:
            self.bridge.post(f"ask/{m}", (self.version, int(min_version)))
        offer: Offer = self.bridge.read(f"offer/{m}")
        if self.heartbeat is not None:
            self.heartbeat.busy(batch)
        barrier()
        if self.leader:
            self.bridge.delete(f"offer/{m}")
        if offer.shutdown:
            return None, m + 1
        if offer.version is None:
            return [], m + 1
        t0 = time.perf_counter()
        self.engine.begin_update()
        for metas, nbytes in offer.buckets:
            flat = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self.bridge.broadcast(flat)
            self.engine.update_weights(unpack_bucket(metas, flat))
            del flat
        self.engine.finish_update()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.version = offer.version
        return [WeightUpdate(offer.version, offer.bytes, offer.wait_s, time.perf_counter() - t0)], m + 1
