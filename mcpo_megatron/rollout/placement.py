"""Where generation runs, behind one interface for the trainer: colocated engines (:class:`LocalRollouts`) or
engines on ranks of their own (:class:`~mcpo_megatron.rollout.separate.remote.RemoteRollouts`).

The trainer submits a generation batch under a key and takes its result later::

    rollouts.submit(key, prompts, sampling, first_index=..., min_version=...)
    ...                                   # separate placement: the engines generate meanwhile
    batch = rollouts.result(key)          # GeneratedBatch: the samples and the policy version that made them
    rollouts.publish(resharder, version)  # the weights after a global step, for the next batches

Colocated, a submitted batch is generated when its result is asked for, by this rank's engine (one replica of
rollout data parallelism, :func:`~mcpo_megatron.rollout.engines.interface.generate_data_parallel`), with the weights of the
last publish, so the loop runs the same code in both placements. A partial-rollout batch
(``rollouts.submit_partial(request)``, ``rollout/partial/segments.py``) is generated segment by segment by the same engines,
and its result holds every record it was sent, finished or not. Every rank of the trainer gets every result.
:class:`RolloutPlacement` is that interface; each placement also accounts for its own engines' time
(:meth:`RolloutPlacement.generation_metrics`), so the trainer never asks which placement it has.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Hashable, Protocol, Sequence

from mcpo_megatron.rollout.engines.interface import RolloutOutput, SamplingParams, StopPoll, generate_data_parallel
from mcpo_megatron.rollout.partial.segments import PartialRequest, generate_partial

if TYPE_CHECKING:
    from mcpo_megatron.rollout.weights.resharder import Resharder, ReshardStats


@dataclass
class WeightUpdate:
    """One weight update an engine took before a batch (or between two segments of one): its policy version,
    bytes, the seconds the engine waited from its ask to the trainer's offer (``wait_s``: for a version it could
    use, and for the trainer's next fixed point) and the seconds the transfer itself took."""

    version: int
    bytes: int = 0
    wait_s: float = 0.0
    transfer_s: float = 0.0
    inflight: bool = False               # taken between two segments of a running batch


@dataclass
class GeneratedBatch:
    """A generation batch's samples and how they were made."""

    output: RolloutOutput               # a partial batch's: rollout/partial/segments.PartialOutput
    version: int                        # the policy version (global steps trained) of the engine weights
    generate_s: float = 0.0             # the engines' generation time
    idle_s: float = 0.0                 # the engines' wait for this request (separate placement)
    updates: list[WeightUpdate] = field(default_factory=list)  # weight updates taken just before it
    # partial rollouts: what the batch did to the pool (trainer/partial_schedule.py), for the step's record
    partial: dict[str, int] = field(default_factory=dict)


class RolloutPlacement(Protocol):
    """Where generation runs, as the trainer sees it: :class:`LocalRollouts` (colocated engines) or
    :class:`~mcpo_megatron.rollout.separate.remote.RemoteRollouts` (engines on ranks of their own)."""

    version: int              # the policy version (global steps trained) of the last publish
    engine_ranks: int         # ranks (devices) the engines have to themselves: 0 when they share the trainer's
    generation_time_key: str  # the step record's seconds of generation, for the generation throughput

    def submit(self, key: Hashable, prompts: list[list[int]], sampling: SamplingParams, *, first_index: int = 0,
               min_version: int = 0) -> None:
        """Queue a generation batch under ``key``, for weights of at least ``min_version``."""

    def submit_partial(self, request: PartialRequest) -> None:
        """Queue a partial-rollout generation batch (``rollout/partial/segments.py``) under ``request.key``."""

    def result(self, key: Hashable, *, should_stop: StopPoll | None = None) -> GeneratedBatch:
        """The batch submitted under ``key`` (:class:`GenerationInterrupted` when ``should_stop`` ends it)."""

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, *, first_index: int = 0,
                 should_stop: StopPoll | None = None) -> RolloutOutput:
        """Generate now with the newest published weights (evaluation, probes)."""

    def publish(self, resharder: Resharder, version: int) -> ReshardStats:
        """The trainer's weights after ``version`` global steps, for the next batches (collective)."""

    def after_rollouts(self) -> None:
        """The step's rollouts are in: free what training needs."""

    def training_state_resident(self) -> contextlib.AbstractContextManager:
        """A context in which the training state is on the trainer's devices (a checkpoint reads it)."""

    def generation_metrics(self, batches: Sequence[GeneratedBatch]) -> dict[str, Any]:
        """This placement's own account of a step's generation ``batches`` (its engines' time, the weights they
        took), merged into the step's record."""

    @property
    def in_flight(self) -> list:
        """The keys submitted and not yet taken."""

    def close(self) -> None:
        """Release (or stop) the engines."""


class LocalRollouts:
    """Colocated engines: this rank's engine generates its replica's share of each batch when the batch's result
    is asked for; ``publish`` streams the trainer's weights into it. Sleeps while the trainer trains.

    With ``offload`` (a :class:`~mcpo_megatron.models.offload.StateOffload`, ``trainer.offload``) the engine and
    the training state take turns on the GPU: ``publish`` moves what the weight update does not read to host
    memory before it wakes the engine and the weights after it has pushed them, so the engine's KV cache gets
    their memory; ``after_rollouts`` puts the engine to sleep and brings the state back."""

    engine_ranks = 0                      # the engines run on the trainer's devices
    generation_time_key = "time/rollout"  # the trainer waits while its own engine generates

    def __init__(self, engine, *, rollout_tp: int = 1, keep_routing_local: bool = False, offload=None):
        self.engine = engine
        self.rollout_tp = int(rollout_tp)
        self.keep_routing_local = keep_routing_local
        self.offload = offload
        self.version = -1
        self._submitted: dict = {}
        self._resharder = None  # the last publish's, to give the engine its weights again after a checkpoint

    def submit(self, key, prompts: list[list[int]], sampling: SamplingParams, *, first_index: int = 0,
               min_version: int = 0) -> None:
        if key in self._submitted:
            raise ValueError(f"generation batch {key!r} was already submitted")
        self._submitted[key] = (prompts, sampling, first_index, min_version)

    def submit_partial(self, request: PartialRequest) -> None:
        if request.key in self._submitted:
            raise ValueError(f"generation batch {request.key!r} was already submitted")
        self._submitted[request.key] = request

    def result(self, key, *, should_stop: StopPoll | None = None) -> GeneratedBatch:
        """Generate the batch submitted under ``key`` now (:class:`GenerationInterrupted` when ``should_stop``
        ends it). Its samples' routing stays on the replica that generated it with ``keep_routing_local``; a
        partial batch's routing travels in its records."""
        item = self._submitted.pop(key)
        min_version = item.min_version if isinstance(item, PartialRequest) else item[3]
        if self.version < min_version:
            raise RuntimeError(f"generation batch {key!r} needs weights of version >= {min_version}; the engine "
                               f"holds version {self.version}")
        t0 = time.perf_counter()
        if isinstance(item, PartialRequest):
            out = generate_partial(self.engine, item, version=self.version, rollout_tp=self.rollout_tp,
                                   should_stop=should_stop)
            return GeneratedBatch(out, self.version, generate_s=time.perf_counter() - t0)
        prompts, sampling, first_index, _ = item
        out = generate_data_parallel(self.engine, prompts, sampling, rollout_tp=self.rollout_tp,
                                     first_index=first_index, should_stop=should_stop,
                                     keep_routing_local=self.keep_routing_local)
        return GeneratedBatch(out, self.version, generate_s=time.perf_counter() - t0)

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, *, first_index: int = 0,
                 should_stop: StopPoll | None = None) -> RolloutOutput:
        """Generate now with the current weights (evaluation, probes); routing is gathered with the samples."""
        return generate_data_parallel(self.engine, list(prompts), sampling, rollout_tp=self.rollout_tp,
                                      first_index=first_index, should_stop=should_stop)

    def publish(self, resharder, version: int):
        """Stream the trainer's weights into the engine (waking it first); returns the resharder's stats. With
        offload, the training state leaves the GPU around it (the weights once the engine has them)."""
        if self.offload is not None:
            self.offload.offload(keep_params=True)
        self.engine.wake_up()
        stats = resharder.push(self.engine)
        if self.offload is not None:
            self.offload.offload()
        self._resharder = resharder
        self.version = int(version)
        return stats

    def after_rollouts(self) -> None:
        """The step's rollouts are in: the engine's memory goes to training (and, offloaded, the state comes
        back: the engine has released its memory first)."""
        self.engine.sleep()
        if self.offload is not None:
            self.offload.onload()

    @contextlib.contextmanager
    def training_state_resident(self):
        """The training state on the GPU for the block (a checkpoint reads it). When it was offloaded the
        engine, which may hold its weights and KV cache, sleeps first; afterwards it gets the same weights again
        (the same version), and the state leaves again."""
        if self.offload is None or not self.offload.offloaded:
            yield
            return
        self.after_rollouts()
        yield  # an error in the block propagates: no collective weight update after it
        self.publish(self._resharder, self.version)

    def generation_metrics(self, batches: Sequence[GeneratedBatch]) -> dict[str, Any]:
        """None of its own: the trainer's ``time/rollout`` is the engine's time, and ``publish`` the weights'."""
        return {}

    @property
    def in_flight(self) -> list:
        return list(self._submitted)

    def close(self) -> None:
        self.engine.close()
