"""The engine ranks' side of separate placement: :class:`RolloutServer` reads each request, takes the newest weights,
generates and reports (the messages: ``rollout/remote_messages.py``; an engine rank's program:
``trainer/rollout_worker.py``).
"""

from __future__ import annotations

import time

import torch

from mcpo_megatron.parallel.bridge import Bridge
from mcpo_megatron.parallel.distributed import barrier
from mcpo_megatron.rollout.engine import GenerationInterrupted, StopPoll, generate_data_parallel
from mcpo_megatron.rollout.liveness import Heartbeat
from mcpo_megatron.rollout.placement import WeightUpdate
from mcpo_megatron.rollout.remote_messages import (STOP_FLAG, GenerateRequest, GenerateResult, Offer, Shutdown,
                                                   unpack_bucket)
from mcpo_megatron.rollout.segments import PartialRequest, generate_partial

FLAG_POLL_S = 0.2    # how often a generating engine looks at the stop flag (a store round trip)


class RolloutServer:
    """The engine ranks' loop: read each request, take the newest weights, generate, report.

    Every engine rank runs it (lockstep over the engine world: the replicas split each batch,
    :func:`generate_data_parallel`); the engine world's rank 0 (the engine leader) writes the asks and results.
    ``should_stop`` is this rank's own stop signal (a preemption); the trainer's stop flag is checked too.
    """

    def __init__(self, bridge: Bridge, engine, *, rank: int, rollout_tp: int = 1, device: torch.device | None = None,
                 should_stop: StopPoll | None = None, heartbeat: Heartbeat | None = None, log=print,
                 bucket_bytes: int = 512 * 2**20):
        self.bridge, self.engine = bridge, engine
        self.heartbeat = heartbeat  # told which batch this rank works on (from its weight update to its report)
        self.leader = rank == 0
        self.rollout_tp = int(rollout_tp)
        self.device = device or torch.device("cpu")
        self.local_stop = should_stop
        self.log = log
        self.version = -1
        self._flag_checked, self._stopped = 0.0, False
        # The reshard plan, when every engine rank's engine takes it (collective with the trainer ranks): the
        # trainer ranks send their shards into this engine's weight target.
        from mcpo_megatron.rollout.remote_plan import compile_remote_plan, offer_readers
        from mcpo_megatron.rollout.reshard_transfer import PlanTransfer

        get = getattr(engine, "weight_target", None)
        self.target = get() if get is not None else None
        plan = compile_remote_plan(bridge, target=self.target, bucket_bytes=bucket_bytes)
        self.transfer = None if plan is None else PlanTransfer(plan, sources=None, destinations=self.target.tensors,
                                                               device=self.device)
        self.readers = offer_readers(bridge.roles, planned=plan is not None)

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
                # The one place an engine takes a published version today: between two requests. In-flight
                # updates (docs/algorithms.md 13.2) add a second, between the segments of a partial batch (_generate).
                updates, m = self._take_weights(req.min_version, m, batch=req.key)
                if updates is None:  # the trainer is shutting down
                    self._report(n, GenerateResult(req.key, None, self.version, idle_s=idle_s))
                    n += 1
                    continue
                t1 = time.perf_counter()
                try:
                    out = self._generate(req)
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

    def _generate(self, req: GenerateRequest | PartialRequest):
        """One request's samples: a whole batch, or a partial-rollout batch segment by segment (rollout/segments.py).

        In-flight weight updates (docs/algorithms.md §13.2, not done yet) go in ``between_segments``: after segment
        k, when the batch goes on, take a published version (at a point fixed in advance for repeatable runs,
        whatever is published for a fast mode) through :meth:`_take_weights`'s transfer, keeping the session's
        running records, and return that version so that the next segment's tokens record it. Until then every
        segment of a batch uses the weights taken before it."""
        if isinstance(req, PartialRequest):
            return generate_partial(self.engine, req, version=self.version, rollout_tp=self.rollout_tp,
                                    should_stop=self.should_stop, between_segments=None)
        return generate_data_parallel(self.engine, req.prompts, req.sampling, rollout_tp=self.rollout_tp,
                                      first_index=req.first_index, should_stop=self.should_stop)

    def _report(self, n: int, result: GenerateResult) -> None:
        if self.leader:
            self.bridge.post(f"res/{n}", result)

    def _take_weights(self, min_version: int, m: int, *, batch) -> tuple[list[WeightUpdate] | None, int]:
        """Ask for the newest weights (at least ``min_version``) and load them if they are newer than ours. Once
        the offer is in (waiting for it can last as long as the trainer trains), this rank works on ``batch``.

        With the reshard plan each round arrives by a bridge ``all_to_all`` from the trainer ranks holding its
        pieces; otherwise each HF bucket by a bridge broadcast from the trainer leader. Either lands in a flat
        ``torch.uint8`` buffer on this rank's device (its GPU over NCCL, or the CPU over gloo), read on this thread's
        current stream, which the bridge made wait for the exchange (it waits on the collective's work), so no read
        comes before the bytes have arrived.
        """
        if self.leader:
            self.bridge.post(f"ask/{m}", (self.version, int(min_version)))
        offer: Offer = self.bridge.read_shared(f"offer/{m}", self.readers)
        if self.heartbeat is not None:
            self.heartbeat.busy(batch)
        if offer.shutdown:
            return None, m + 1
        if offer.version is None:
            return [], m + 1
        t0 = time.perf_counter()
        nbytes = self._receive_planned() if self.transfer is not None else self._receive_buckets(offer)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.version = offer.version
        return [WeightUpdate(offer.version, nbytes, offer.wait_s, time.perf_counter() - t0)], m + 1

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
