"""The engine ranks' side of separate placement: :class:`RolloutServer` reads each request, takes the newest weights,
generates and reports (the messages: ``rollout/separate/messages.py``; an engine rank's program:
``trainer/rollout_worker.py``).
"""

from __future__ import annotations

import time

import torch

from mcpo_megatron.parallel.bridge import Bridge
from mcpo_megatron.parallel.distributed import barrier, broadcast_object
from mcpo_megatron.rollout.engines.interface import GenerationInterrupted, generate_data_parallel
from mcpo_megatron.rollout.separate.liveness import Heartbeat
from mcpo_megatron.rollout.placement import WeightUpdate
from mcpo_megatron.rollout.separate.messages import (STOP_FLAG, GenerateRequest, GenerateResult, InflightAsk, Offer,
                                                   Shutdown, unpack_bucket)
from mcpo_megatron.rollout.partial.segments import PartialRequest, generate_partial
from mcpo_megatron.rollout.separate.publisher import staged_flag

FLAG_POLL_S = 0.2    # how often a generating engine looks at the stop flag (a store round trip)


class RolloutServer:
    """The engine ranks' loop: read each request, take the newest weights, generate, report.

    Every engine rank runs it (lockstep over the engine world: the replicas split each batch,
    :func:`generate_data_parallel`); the engine world's rank 0 (the engine leader) writes the asks and results.
    A batch stops early only when the trainer sets its stop flag (it shuts down): a preemption signal reaching an
    engine rank is the trainer's to act on, which may need the batch finished (``trainer/held_batches.py``).
    """

    def __init__(self, bridge: Bridge, engine, *, rank: int, rollout_tp: int = 1, device: torch.device | None = None,
                 heartbeat: Heartbeat | None = None, log=print,
                 bucket_bytes: int = 512 * 2**20):
        self.bridge, self.engine = bridge, engine
        self.heartbeat = heartbeat  # told which batch this rank works on (from its weight update to its report)
        self.leader = rank == 0
        self.rollout_tp = int(rollout_tp)
        self.device = device or torch.device("cpu")
        self.log = log
        self.version = -1
        self._asks = 0                     # weight asks so far (before batches and between segments)
        self._updates: list[WeightUpdate] = []  # the weight updates taken for the request being served
        self._flag_checked, self._stopped = 0.0, False
        # The reshard plan, when every engine rank's engine takes it (collective with the trainer ranks): the
        # trainer ranks send their shards into this engine's weight target.
        from mcpo_megatron.rollout.separate.plan import compile_remote_plan
        from mcpo_megatron.rollout.weights.transfer import PlanTransfer

        get = getattr(engine, "weight_target", None)
        self.target = get() if get is not None else None
        plan = compile_remote_plan(bridge, target=self.target, bucket_bytes=bucket_bytes)
        self.transfer = None if plan is None else PlanTransfer(plan, sources=None, destinations=self.target.tensors,
                                                               device=self.device)
        self.readers = bridge.roles.rollout_ranks  # every engine rank reads every offer

    def should_stop(self) -> bool:
        """The trainer's stop flag (a store read at most every FLAG_POLL_S)."""
        if self._stopped:
            return True
        now = time.monotonic()
        if now - self._flag_checked > FLAG_POLL_S:
            self._flag_checked = now
            self._stopped = self.bridge.flag(STOP_FLAG)
        return self._stopped

    def serve(self) -> int:
        """Serve requests until :class:`Shutdown`; returns how many batches were generated."""
        n = served = 0
        while True:
            t0 = time.perf_counter()
            req = self.bridge.read(f"req/{n}")
            barrier()  # every engine rank has read it
            if self.leader:
                self.bridge.delete(f"req/{n}")
            idle_s = time.perf_counter() - t0
            if isinstance(req, Shutdown):
                if self.leader:
                    self.bridge.post(f"ask/{self._asks}", "bye")
                return served
            try:
                # An engine takes a published version here, between two requests, and with in-flight updates also
                # between two segments of a partial batch (_generate).
                self._updates = []
                if not self._take_weights((self.version, int(req.min_version)), batch=req.key):
                    # the trainer is shutting down
                    self._report(n, GenerateResult(req.key, None, self.version, idle_s=idle_s))
                    n += 1
                    continue
                t1 = time.perf_counter()
                try:
                    out = self._generate(req)
                except GenerationInterrupted:
                    out = None
                self._report(n, GenerateResult(req.key, out, self.version, generate_s=time.perf_counter() - t1,
                                               idle_s=idle_s, updates=self._updates))
                served += out is not None
            except Exception as e:
                self._report(n, GenerateResult(req.key, None, self.version, error=f"{type(e).__name__}: {e}"))
                raise
            finally:
                if self.heartbeat is not None:
                    self.heartbeat.idle()
            n += 1

    def _generate(self, req: GenerateRequest | PartialRequest):
        """One request's samples: a whole batch, or a partial-rollout batch segment by segment (rollout/partial/segments.py),
        taking a newer version between two segments when the request says so (:meth:`_between_segments`)."""
        if isinstance(req, PartialRequest):
            between = None if req.inflight == "off" else lambda k, version: self._between_segments(req, k, version)
            return generate_partial(self.engine, req, version=self.version, rollout_tp=self.rollout_tp,
                                    should_stop=self.should_stop, between_segments=between)
        return generate_data_parallel(self.engine, req.prompts, req.sampling, rollout_tp=self.rollout_tp,
                                      first_index=req.first_index, should_stop=self.should_stop)

    def _between_segments(self, req: PartialRequest, k: int, version: int) -> int:
        """In-flight weight updates (docs/algorithms.md §13.2): after segment ``k`` of a running batch, take the
        version of the batch's own step (``req.inflight_version``) without draining its records. Repeatable: after
        exactly segment ``req.update_after``, waiting for it if the trainer has not published it yet; fast: at the
        first boundary at which it is published. Every engine rank asks the same and reads the same offer; returns
        the version the next segment's tokens record (the running records keep the KV cache the older weights
        computed)."""
        if version >= req.inflight_version:
            return version
        repeatable = req.inflight == "repeatable"
        if repeatable and k != req.update_after:
            return version
        if not repeatable and not self._staged(req.inflight_version):
            return version  # fast: not published yet, go on without asking
        if not self._take_weights(InflightAsk(self.version, req.inflight_version, block=repeatable), inflight=True):
            raise GenerationInterrupted(f"the trainer stopped while batch {req.key!r} waited for version "
                                        f"{req.inflight_version}")
        return self.version

    def _report(self, n: int, result: GenerateResult) -> None:
        if self.leader:
            self.bridge.post(f"res/{n}", result)

    def _staged(self, version: int) -> bool:
        """Whether the trainer has staged ``version``: one look at the store by the engine leader, shared with the
        other engine ranks so that all of them go on the same way."""
        seen = self.bridge.flag(staged_flag(version)) if self.leader else None
        return bool(broadcast_object(seen, src=0))

    def _take_weights(self, ask, *, batch=None, inflight: bool = False) -> bool:
        """Ask the trainer leader for weights and load them if it offers a version: before a batch ``ask`` =
        (version held, the batch's ``min_version``), and once the offer is in (waiting for it can last as long as
        the trainer trains: the leader answers at its fixed points, ``rollout/separate/remote.py``) this rank works on
        ``batch``; between two segments an :class:`InflightAsk`. The update is recorded in ``self._updates``, with
        this rank's wait from the ask to the offer; returns False when the trainer is shutting down.

        With the reshard plan each round arrives by a bridge ``all_to_all`` from the trainer ranks holding its
        pieces; otherwise each HF bucket by a bridge broadcast from the trainer leader. Either lands in a flat
        ``torch.uint8`` buffer on this rank's device (its GPU over NCCL, or the CPU over gloo), read on this thread's
        current stream, which the bridge made wait for the exchange (it waits on the collective's work), so no read
        comes before the bytes have arrived. On a GPU the exchange starts once every kernel issued before it has
        finished (the bridge's communicator and the engine's own are used in different epochs, as on the trainer
        ranks) and the update is complete on the device before generation goes on.
        """
        m, self._asks = self._asks, self._asks + 1
        t_ask = time.perf_counter()
        if self.leader:
            self.bridge.post(f"ask/{m}", ask)
        offer: Offer = self.bridge.read_shared(f"offer/{m}", self.readers)
        wait_s = time.perf_counter() - t_ask
        if self.heartbeat is not None and batch is not None:
            self.heartbeat.busy(batch)
        if offer.shutdown:
            return False
        if offer.version is None:
            return True
        t0 = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        nbytes = self._receive_planned() if self.transfer is not None else self._receive_buckets(offer)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.version = offer.version
        self._updates.append(WeightUpdate(offer.version, nbytes, wait_s, time.perf_counter() - t0,
                                          inflight=inflight))
        return True

    def _receive_planned(self) -> int:
        """Every round of the plan from the trainer ranks, written into the engine's weight target; returns the
        bytes written."""
        if self.target.begin is not None:
            self.target.begin()
        with torch.no_grad():
            stats = self.transfer.run(lambda recv, send, recv_sizes, send_sizes:
                                      self.bridge.all_to_all(recv, send, recv_sizes, send_sizes))
        if self.target.finish is not None:
            self.target.finish()
        return stats.bytes

    def _receive_buckets(self, offer: Offer) -> int:
        """The trainer leader's HF buckets, each broadcast into a buffer and loaded by the engine."""
        self.engine.begin_update()
        for metas, nbytes in offer.buckets:
            flat = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self.bridge.broadcast(flat)
            self.engine.update_weights(unpack_bucket(metas, flat))
            del flat
        self.engine.finish_update()
        return offer.bytes
