"""Rollout engines on ranks of their own (``rollout.placement=separate``): the trainer's side,
:class:`RemoteRollouts`. The engines' side is :class:`~mcpo_megatron.rollout.rollout_server.RolloutServer`, the
weights between them go through :class:`~mcpo_megatron.rollout.weight_publisher.WeightPublisher`, and the messages
and their keys are ``rollout/remote_messages.py``. Transport: :class:`~mcpo_megatron.parallel.bridge.Bridge`.

Staleness (docs/algorithms.md, section 13). A batch for global step s is submitted with ``min_version = s -
max_staleness``; an engine keeps its weights when they are at least that recent, else loads exactly that version (or
the first one published, after a resume). So a trained sample's staleness never exceeds ``max_staleness``, and which
version a batch gets never depends on timing: a run repeats exactly, at any staleness. The price: with
``max_staleness`` >= 2 the engines use weights that old even when newer ones exist (they buffer up to that many
batches ahead, which absorbs uneven generation times, but do not make the samples fresher).
"""

from __future__ import annotations

import contextlib

import dataclasses
import time
from typing import Any, Callable, Sequence

import torch

from mcpo_megatron.parallel.bridge import POLL_S, Bridge, Stopped
from mcpo_megatron.parallel.distributed import broadcast_object, new_gloo_group
from mcpo_megatron.rollout.engine import GenerationInterrupted, RolloutOutput, SamplingParams, StopPoll
from mcpo_megatron.rollout.liveness import EnginesFailed, EngineWatch, Waits, engine_names
from mcpo_megatron.rollout.placement import GeneratedBatch
from mcpo_megatron.rollout.remote_messages import STOP_FLAG, GenerateRequest, GenerateResult, Shutdown
from mcpo_megatron.rollout.segments import PartialRequest
from mcpo_megatron.rollout.weight_publisher import WeightPublisher


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

    def __init__(self, bridge: Bridge, *, engine_ranks: int, waits: Waits, comm_device: torch.device | None = None,
                 model_chunks=None, bucket_bytes: int = 512 * 2**20):
        if engine_ranks < 1:
            raise ValueError(f"RemoteRollouts: engine_ranks={engine_ranks} must be >= 1 (the engines' own ranks)")
        self.engine_ranks = int(engine_ranks)
        self.bridge = bridge
        self.leader = bridge.rank == 0
        self.wait_group = new_gloo_group(waits.trainer_group_s)
        self.watch = EngineWatch(bridge.store, engine_names(bridge.roles), waits) if self.leader else None
        self.shards = self.follower = None
        # The reshard plan, when every engine takes it (collective with the engine ranks, which compile it too).
        from mcpo_megatron.rollout.remote_plan import OfferFollower, StagedShards, compile_remote_plan, offer_readers

        check = (lambda: self.watch.check("the engine ranks' weight layouts")) if self.leader else None
        plan = compile_remote_plan(bridge, model_chunks=model_chunks, bucket_bytes=bucket_bytes, check=check)
        if plan is not None:
            from mcpo_megatron.models.hf_io import source_tensors

            self.shards = StagedShards(plan, source_tensors(model_chunks), bridge, comm_device or torch.device("cpu"))
            if not self.leader:
                self.follower = OfferFollower(bridge, self.shards, offer_readers(bridge.roles, planned=True))
        self.publisher = WeightPublisher(bridge, comm_device=comm_device, shards=self.shards) if self.leader else None
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

    def submit_partial(self, request: PartialRequest) -> None:
        """Queue a partial-rollout generation batch (``rollout/segments.py``): the request itself is the message."""
        key = request.key
        if key in self._requests:
            raise ValueError(f"generation batch {key!r} was already submitted")
        n, self._next = self._next, self._next + 1
        self._requests[key] = n
        if self.leader:
            self.publisher.expect(request.min_version)
            self.bridge.post(f"req/{n}", request)

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
            if res is not None and isinstance(res.output, RolloutOutput) and res.output.routed_experts is not None:
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
        """Stage the trainer's weights as ``version`` for the engines (collective over the trainer ranks); the engines
        load it before their next batch. With the reshard plan every trainer rank stages its own shards (sent when
        the engines ask); otherwise the leader stages the HF stream (the other ranks take part in its gathers).

        First the leader waits, watching the engines, until they have taken the staged version for every batch
        that needs it, and starts staging; the other trainer ranks wait for its verdict (:meth:`_share`) rather than
        in the reshard's gathers, so an engine failure reaches them as the leader's error. The verdict carries how
        many offers were made so far: a rank rewrites its staged shards only after its sender has finished them."""
        error, offers = None, 0
        if self.leader:
            self.publisher.next_version = int(version)
            try:
                self._gate_wait_s = self.publisher.wait_until_free(
                    self._watching(f"the engines to take version {self.version} before version {version} is staged"))
                offers = self.publisher.begin_staging()
            except EnginesFailed as e:
                self.failed, error = True, str(e)
        error, offers = self._share((error, offers))
        if error is not None:
            raise RuntimeError(f"the rollout ranks failed before version {version} could be published: {error}")
        if self.shards is not None:
            stats = self._stage_shards(offers)
        else:
            stats = resharder.push(self.publisher if self.leader else _Discard(), stream=True)
        self.version = int(version)
        return stats

    def _stage_shards(self, offers: int):
        from mcpo_megatron.rollout.reshard import ReshardStats

        def check() -> None:
            failed = self.follower.error if self.follower is not None else self.publisher.error
            if failed is not None:
                raise RuntimeError(f"sending weights to the engine ranks failed: {failed!r}") from failed

        self.shards.wait_processed(offers, check)
        nbytes, seconds = self.shards.stage()
        if self.leader:
            self.publisher.finish_update()
        plan = self.shards.transfer.plan
        return ReshardStats(seconds=seconds, bytes=nbytes, gbps=nbytes / max(seconds, 1e-12) / 1e9,
                            buckets=plan.num_rounds, max_bucket_bytes=plan.max_send_bytes,
                            tensors=len(plan.sources), path="plan", collectives=0, sent_bytes=nbytes)

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
                "async/inflight_updates": sum(u.inflight for u in updates),
                "reshard/transfer_s": seconds, "reshard/transfer_gbps": nbytes / seconds / 1e9 if seconds else 0.0}

    def after_rollouts(self) -> None:
        """The engines have GPUs of their own: nothing to free. The staged shards' copies (asynchronous on GPUs)
        come before training changes the parameters."""
        if self.shards is not None:
            self.shards.before_training()

    def training_state_resident(self):
        """The training state never leaves the trainer's GPUs (no engine shares them)."""
        return contextlib.nullcontext()

    @property
    def in_flight(self) -> list:
        return list(self._requests)

    def close(self) -> None:
        """Stop the engines: abandon what they generate, end their loop, wait for their goodbye (none after the
        engines were declared failed, or once they fall silent: the launcher ends them)."""
        if not self.leader:
            if self.follower is not None:
                self.follower.join(POLL_S * 50)
            return
        self.bridge.set_flag(STOP_FLAG)
        self.bridge.post(f"req/{self._next}", Shutdown())
        self._next += 1
        if not self.failed:
            self.publisher.close(check=lambda: self.watch.check("the engines' goodbye"))
