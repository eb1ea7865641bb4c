"""Rollout engines on ranks of their own (``rollout.placement=separate``): the trainer's side,
:class:`RemoteRollouts`. The engines' side is :class:`~mcpo_megatron.rollout.separate.server.RolloutServer`, the
weights between them go through :class:`~mcpo_megatron.rollout.separate.publisher.WeightPublisher`, and the messages
and their keys are ``rollout/separate/messages.py``. Transport: :class:`~mcpo_megatron.parallel.bridge.Bridge`.

Staleness (docs/algorithms.md, section 13). A batch for global step s is submitted with ``min_version = s -
max_staleness``; an engine keeps its weights when they are at least that recent, else loads exactly that version (or
the first one published, after a resume). So a trained sample's staleness never exceeds ``max_staleness``, and which
version a batch gets never depends on timing: a run repeats exactly, at any staleness. The price: with
``max_staleness`` >= 2 the engines use weights that old even when newer ones exist (the batches are submitted that
many steps ahead, which absorbs uneven generation times as far as the fixed points below let the engines run ahead,
but does not make the samples fresher).

The rule for the bridge's collectives (docs/decisions.md, "The bridge's collectives at fixed points of the step").
The weights go over the bridge in collectives: with the reshard plan one ``all_to_all`` of every trainer and engine
rank per round, otherwise the trainer leader's broadcasts to the engine ranks. On GPUs they are NCCL collectives,
and the trainer's GPU also runs the training's (TP all-reduce, DP reduce-scatter and all-gather, PP send and
receive) over other communicators. NCCL's user guide ("Using multiple NCCL communicators concurrently") asks that
operations on different communicators be used at different epochs, submitted in the same order on every rank:
an NCCL kernel waits for its peers while it occupies the GPU, and with ``CUDA_DEVICE_MAX_CONNECTIONS=1``
(``slurm/common.sh``) the streams of a GPU share one hardware queue, so a bridge collective issued by another
thread at a moment that differs between ranks would wait forever for a rank whose training collective is queued
behind it. A lock on each rank cannot help: the order has to agree across ranks. So:

* bridge collectives are issued only by the trainer ranks' main threads, at **fixed points**: :meth:`submit`,
  :meth:`result` and :meth:`publish` (before staging while the staged version is still needed, and after it) -
  calls that every trainer rank makes in the same order (the generation schedule is the same on every rank),
  between training steps or phases, never inside one;
* at a fixed point the leader answers the engines' asks (:meth:`WeightPublisher.answer_asks`): every ask that has
  arrived, and the one that is due (the engines have reported the batch before the next one they ask for, and
  that one is submitted: their ask follows within a store round trip, so the leader waits for it). An answer that
  offers a version becomes the verdict "send it", shared over the wait group (:meth:`_fixed_point`), and every
  trainer rank sends its part; then the leader looks again. The fixed point ends with the leader's verdict on what
  it waited for (the result, the staged version free to be replaced, nothing), shared the same way;
* a send waits until every kernel issued before it on the rank's GPU has finished (a device synchronize) and
  returns once its own have, so the bridge's communicator and the training's are used in different epochs, in the
  same order on every trainer rank; the engine ranks take part from their main thread, in the order of their asks
  (``rollout_server.py``).

Without CUDA the same fixed points run over gloo, so the CPU tests exercise the rule as the GPUs run it.

What stays overlapped: the engines generate while the trainer trains as before; the weights for a batch submitted
ahead go at the submit (when the engines wait for it) or at the end of the wait for the batch before it. What it
costs: the trainer ranks send at the fixed point, so the transfer is on the trainer's path; and an ask that arrives
while the trainer trains waits for its next fixed point: an in-flight update asked for after the trainer's publish
(until the next step's first submit or wait), or at ``trainer.max_staleness`` >= 2 a batch the engines reach during
a step (until the publish that ends it, which waits for that batch's weights to be taken, as before).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from mcpo_megatron.parallel.bridge import POLL_S, Bridge
from mcpo_megatron.parallel.distributed import broadcast_object, new_gloo_group
from mcpo_megatron.rollout.engines.interface import GenerationInterrupted, RolloutOutput, SamplingParams, StopPoll
from mcpo_megatron.rollout.separate.liveness import EnginesFailed, EngineWatch, Waits, engine_names
from mcpo_megatron.rollout.placement import GeneratedBatch
from mcpo_megatron.rollout.separate.messages import STOP_FLAG, GenerateRequest, GenerateResult, Shutdown
from mcpo_megatron.rollout.partial.segments import PartialRequest
from mcpo_megatron.rollout.separate.publisher import WeightPublisher


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


@dataclass
class _Send:
    """The leader's verdict at a fixed point: every trainer rank sends its part of the staged ``version`` now (the
    engines took the offer of it)."""

    version: int


@dataclass
class _Done:
    """The leader's verdict that ends a fixed point, with what it waited for."""

    value: Any


@dataclass
class _Failed:
    """The leader's verdict when it raised at a fixed point: every trainer rank raises ``message``."""

    message: str


class RemoteRollouts:
    """The trainer's handle on the engine ranks (every trainer rank holds one; the leader, trainer rank 0, talks
    to the engines and shares each result with the others). Same interface as
    :class:`~mcpo_megatron.rollout.placement.LocalRollouts`.

    :meth:`submit`, :meth:`result` and :meth:`publish` are collective over the trainer ranks: each is a fixed point
    (the module docstring), at which the other trainer ranks wait for the leader's verdicts in broadcasts over a gloo
    group of the trainer ranks whose timeout is ``waits.trainer_group_s`` (:meth:`_share`). While the leader waits
    on the engines (for a result, their ask, or before staging a version) it watches their heartbeats
    (:class:`~mcpo_megatron.rollout.separate.liveness.EngineWatch`) within the limits of ``waits``; whatever it raises there
    (the engines failed, a store error, a message it cannot read) is its verdict, so every trainer rank raises it.
    Creating it is collective over the trainer ranks (the group). ``engine_ranks``: how many ranks the engines run
    on.
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
        self.shards = None
        # The reshard plan, when every engine takes it (collective with the engine ranks, which compile it too).
        from mcpo_megatron.rollout.separate.plan import StagedShards, compile_remote_plan

        check = (lambda: self.watch.check("the engine ranks' weight layouts")) if self.leader else None
        plan = compile_remote_plan(bridge, model_chunks=model_chunks, bucket_bytes=bucket_bytes, check=check)
        if plan is not None:
            from mcpo_megatron.models.hf_io import source_tensors

            self.shards = StagedShards(plan, source_tensors(model_chunks), bridge, comm_device or torch.device("cpu"))
        self.publisher = WeightPublisher(bridge, comm_device=comm_device, shards=self.shards) if self.leader else None
        self.failed = False               # the leader declared the engines failed: close() waits for nothing
        self.version = -1
        self.wait_s = 0.0                 # the trainer's wait for the last result
        self.publish_wait_s = 0.0         # the last publish's fixed points: the engines taking the staged version
        self._next = 0
        self._requests: dict[Any, int] = {}
        self._reported: set[int] = set()  # the leader: requests whose result it took
        self._leader_error: BaseException | None = None  # the leader: what it raised at the last failed fixed point

    def submit(self, key, prompts: list[list[int]], sampling: SamplingParams, *, first_index: int = 0,
               min_version: int = 0) -> None:
        """Queue a generation batch (collective over the trainer ranks: a fixed point, at which the engines get
        its weights when they are waiting for it)."""
        self._submit(key, min_version, lambda: GenerateRequest(key, [list(p) for p in prompts], sampling,
                                                               first_index, min_version))

    def submit_partial(self, request: PartialRequest) -> None:
        """Queue a partial-rollout generation batch (``rollout/partial/segments.py``): the request itself is the message."""
        self._submit(request.key, request.min_version, lambda: request)

    def _submit(self, key, min_version: int, message: Callable[[], Any]) -> None:
        """Post the request (the leader, as its part of the fixed point that follows)."""
        if key in self._requests:
            raise ValueError(f"generation batch {key!r} was already submitted")
        n, self._next = self._next, self._next + 1
        self._requests[key] = n

        def post() -> None:
            self.publisher.expect(min_version)
            self.bridge.post(f"req/{n}", message())

        self._fixed_point(lambda: (True, None), first=post, what=f"the engines' ask for generation batch {key!r}",
                          failed=f"the rollout ranks failed when generation batch {key!r} was submitted",
                          during=f"submitting generation batch {key!r}")

    def _watching(self, what: str) -> Callable[[], None]:
        """The leader's check while it waits for ``what``: raises :class:`EnginesFailed` when an engine rank is
        silent or over the batch limit, or this wait outlasted ``waits.leader_s``."""
        since = self.watch.clock()
        return lambda: self.watch.check(what, since)

    def _share(self, obj: Any) -> Any:
        """The leader's ``obj`` on every trainer rank: a broadcast over the wait group (the object pickled into a
        CPU ``torch.uint8`` tensor after a CPU ``torch.int64`` size, over gloo, with CUDA too), in which the other
        trainer ranks wait while the leader waits on the engines."""
        return broadcast_object(obj, src=0, group=self.wait_group)

    # ------------------------------------------------------------------ fixed points
    def _fixed_point(self, step: Callable[[], tuple[bool, Any]], *, what: str, failed: str, during: str,
                     first: Callable[[], None] | None = None) -> Any:
        """A fixed point of the step (the rule: the module docstring); collective over the trainer ranks, which
        return the ``value`` of the leader's ``step()``.

        The leader runs ``first()`` once, then until ``step()`` returns ``(True, value)`` and no ask of the engines
        is due, answers their asks, watching them (``what``: what it waits for). Each answer that offers a version
        is a verdict: every trainer rank sends its part (:meth:`StagedShards.send`, the bridge ``all_to_all``
        rounds; HF buckets go from the leader alone, within its part), and the leader goes on. Whatever the leader
        raises is its verdict too: every trainer rank raises RuntimeError with the message, which begins with
        ``failed`` when the engines failed (:class:`EnginesFailed`), and names the leader's error raised while
        ``during`` otherwise."""
        while True:
            verdict = self._verdict(step, what, failed, during, first) if self.leader else None
            first = None
            verdict = self._share(verdict)
            if isinstance(verdict, _Send):
                self.shards.send(verdict.version)
            elif isinstance(verdict, _Failed):
                raise RuntimeError(verdict.message) from (self._leader_error if self.leader else None)
            else:
                return verdict.value

    def _verdict(self, step, what: str, failed: str, during: str, first) -> _Send | _Done | _Failed:
        """The leader's next verdict at a fixed point (:meth:`_fixed_point`)."""
        self._leader_error = None
        try:
            if first is not None:
                first()
            check = self._watching(what)
            pause, seen = 1e-3, None  # as Bridge.wait: a quick answer is seen at once, a long wait costs few looks
            while True:
                done, value = step()
                offer = self.publisher.answer_asks()
                if offer is not None:
                    if self.shards is not None:
                        return _Send(offer.version)
                    self.publisher.send_buckets()  # the leader and the engines only
                    continue
                if done and not self._ask_due():
                    return _Done(value)
                check()
                if seen != (done, self.publisher.asks):  # something came: the next may follow at once
                    pause, seen = 1e-3, (done, self.publisher.asks)
                time.sleep(pause)
                pause = min(pause * 2, POLL_S)
        except EnginesFailed as e:
            self.failed = True
            self._leader_error = e
            return _Failed(f"{failed}: {e}")
        except BaseException as e:  # noqa: BLE001 - every trainer rank raises it
            self._leader_error = e
            return _Failed(f"the trainer leader failed while {during}: {type(e).__name__}: {e}")

    def _ask_due(self) -> bool:
        """The engines are about to ask for the request after the last one they asked for: they have reported the
        one before it, and it is submitted (the engine leader reads the next request and asks at once)."""
        k = self.publisher.asked
        if k >= self.publisher.requests:
            return False
        self._reported = {r for r in self._reported if r >= k - 1}
        return k == 0 or k - 1 in self._reported or self.bridge.ready(f"res/{k - 1}")

    # ------------------------------------------------------------------ results and weights
    def result(self, key, *, should_stop: StopPoll | None = None) -> GeneratedBatch:
        """Wait for the batch submitted under ``key``; collective over the trainer ranks (a fixed point). Raises
        :class:`GenerationInterrupted` when the leader's ``should_stop`` turned true first (or the engines were
        interrupted), and RuntimeError on every trainer rank when the engines failed (an error they reported,
        or the leader's watch: a silent engine rank, a batch or wait over its limit) or the leader did."""
        n = self._requests.pop(key)
        got: dict[str, Any] = {}
        t0 = time.perf_counter()

        def step() -> tuple[bool, Any]:
            if "res" not in got:
                if not self.bridge.ready(f"res/{n}"):
                    if should_stop is not None and should_stop():
                        return True, None
                    if self.publisher.held is not None:
                        raise RuntimeError(
                            f"generation batch {key!r} cannot be finished: the engines wait for a version that "
                            f"is not staged ({self.publisher.held!r}; staged: {self.publisher.version}), which "
                            "the trainer publishes only after this batch is back")
                    return False, None
                res = self.bridge.take(f"res/{n}")
                self._reported.add(n)
                got["res"], got["kept"] = res, None
                if isinstance(res.output, RolloutOutput) and res.output.routed_experts is not None:
                    got["res"], got["kept"] = _routing_stays_with_the_leader(res)
            return True, got["res"]

        res = self._fixed_point(step, what=f"generation batch {key!r}",
                                failed=f"the rollout ranks failed on generation batch {key!r}",
                                during=f"waiting for generation batch {key!r}")
        if got.get("kept") is not None:
            res.output = got["kept"]
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

        Two fixed points: before staging, until the engines have taken the staged version for every batch that
        needs it (the leader answers their asks meanwhile, watching them; an engine failure reaches every trainer
        rank as the leader's verdict); after it, for the asks that waited for this version."""
        version = int(version)
        t0 = time.perf_counter()
        self._fixed_point(lambda: (not self.publisher.needed(), None),
                          what=f"the engines to take version {self.version} before version {version} is staged",
                          failed=f"the rollout ranks failed before version {version} could be published",
                          during=f"publishing version {version}")
        waited = time.perf_counter() - t0
        if self.shards is not None:
            stats = self._stage_shards(version)
        else:
            stats = resharder.push(self.publisher if self.leader else _Discard(), stream=True)
        t1 = time.perf_counter()
        self._fixed_point(lambda: (True, None), first=lambda: self.publisher.staged(version),
                          what=f"the engines' asks for version {version}",
                          failed=f"the rollout ranks failed after version {version} was staged",
                          during=f"publishing version {version}")
        self.publish_wait_s = waited + time.perf_counter() - t1
        self.version = version
        return stats

    def _stage_shards(self, version: int):
        from mcpo_megatron.rollout.weights.resharder import ReshardStats

        nbytes, seconds = self.shards.stage(version)
        plan = self.shards.transfer.plan
        return ReshardStats(seconds=seconds, bytes=nbytes, gbps=nbytes / max(seconds, 1e-12) / 1e9,
                            buckets=plan.num_rounds, max_bucket_bytes=plan.max_send_bytes,
                            tensors=len(plan.sources), path="plan", collectives=0, sent_bytes=nbytes)

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
            return
        self.bridge.set_flag(STOP_FLAG)
        self.bridge.post(f"req/{self._next}", Shutdown())
        self._next += 1
        if not self.failed:
            self.publisher.close(check=lambda: self.watch.check("the engines' goodbye"))
