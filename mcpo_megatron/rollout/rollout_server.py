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
