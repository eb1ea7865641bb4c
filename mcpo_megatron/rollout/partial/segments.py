"""A partial-rollout generation batch on the engines: groups of records generated segment by segment until the
batch's completion rule holds (docs/algorithms.md §13, docs/decisions.md, "Partial rollouts").

The trainer sends a :class:`PartialRequest`: groups (a prompt and its unfinished members), how many of them must be
complete (``need``), which must be complete whatever the count (``due``: their oldest token would be too stale
for a later step), ``segment_tokens``, and ``min_steps``, the decoding steps a batch runs at least while records
run (its pace: a response carried over several batches progresses by about as much in each). :func:`generate_partial` runs it on the engines, colocated
(``rollout/placement.LocalRollouts``) or on ranks of their own (``rollout/separate/server.RolloutServer``), with
the same code: each rollout replica opens a session (``rollout/engines/records.py``) on a contiguous share of the groups;
after every segment of ``segment_tokens`` decoding steps the replicas exchange which groups are complete and stop
together when :func:`batch_done` says so. The rule is evaluated only at segment boundaries, so where a batch ends
depends on the records, the weights and ``segment_tokens``, never on timing: the batch repeats exactly.

The hook ``between_segments`` is where an engine takes a new policy version without draining its running records
(in-flight weight updates, docs/algorithms.md §13.2: ``rollout/separate/server.RolloutServer`` passes one).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from mcpo_megatron.rollout.engines.interface import GenerationInterrupted, SamplingParams, StopPoll, replica_slices
from mcpo_megatron.rollout.engines.records import SequenceRecord

# between_segments(segments done so far, version) -> the policy version of the weights for the next segment
BetweenSegments = Callable[[int, int], int]


@dataclass
class GroupWork:
    """One prompt's members still to generate: ``members`` are its unfinished records (the finished ones stay
    with the trainer); the group is complete once they all finished."""

    key: int                           # the trainer's id of the group
    prompt: list[int]
    members: list[SequenceRecord]
    due: bool = False                  # must be complete before the batch ends (trainer.staleness_policy=wait)


@dataclass
class PartialRequest:
    """A partial-rollout generation batch (also the message to engine ranks, ``req/n`` of
    ``rollout/separate/messages.py``)."""

    key: Any
    groups: list[GroupWork]
    need: int                          # end once this many of the groups are complete (and every due group)
    sampling: SamplingParams           # n and seed unused: every record is one sample with its own seed
    segment_tokens: int
    min_version: int = 0               # separate placement: the oldest weights the batch may be generated with
    min_steps: int = 0                 # while records run, the batch runs at least this many decoding steps
    # In-flight weight updates (separate placement, rollout.partial.inflight_updates): "off", "repeatable" (take
    # version inflight_version after segment update_after, waiting for it) or "fast" (at the first segment boundary
    # after it is published).
    inflight: str = "off"
    inflight_version: int = -1
    update_after: int = 1


@dataclass
class PartialOutput:
    """What a partial batch generated: per group of the request, its members as they stand (finished or not)."""

    members: list[list[SequenceRecord]]
    segments: int                      # segments run
    versions: list[int] = field(default_factory=list)  # the policy version of each segment

    def complete(self) -> list[bool]:
        return [all(r.finished for r in group) for group in self.members]


def batch_done(complete: set, due: set, need: int, running: int, steps: int = 0, min_steps: int = 0) -> bool:
    """The completion rule, checked at segment boundaries: nothing is running any more, or at least ``need``
    groups are complete, every ``due`` group is among them and the batch ran ``min_steps`` decoding steps."""
    return running == 0 or (len(complete) >= need and due <= complete and steps >= min_steps)


def generate_partial(engine, request: PartialRequest, *, version: int, rollout_tp: int = 1, group=None,
                     should_stop: StopPoll | None = None,
                     between_segments: BetweenSegments | None = None) -> PartialOutput:
    """Run ``request`` on ``engine`` (this rank's; every rank of the group calls it) with the weights of policy
    ``version``. The ``world / rollout_tp`` replicas each take a contiguous share of the groups; after each segment
    one object all-gather over ``group`` tells every rank which groups are complete, how many records run, and
    whether any rank was interrupted (then every rank raises :class:`GenerationInterrupted`). The result, gathered
    from each replica's first rank, is the same on every rank. ``between_segments(k, version)`` runs on every rank
    after segment k when the batch goes on, and returns the version of the next segment's weights."""
    import torch.distributed as dist

    distributed = dist.is_initialized()
    world = dist.get_world_size(group) if distributed else 1
    rank = dist.get_rank(group) if distributed else 0
    if rollout_tp < 1 or world % rollout_tp:
        raise ValueError(f"rollout_tp={rollout_tp!r} must be >= 1 and divide the world size {world}; set "
                         "rollout.tensor_parallel_size to a divisor of the number of processes")
    replica = rank // rollout_tp
    start, stop = replica_slices(len(request.groups), world // rollout_tp)[replica]
    mine = request.groups[start:stop]
    prompts = [g.prompt for g in mine for _ in g.members]
    session = engine.open_session(prompts, [r for g in mine for r in g.members], request.sampling)
    due = {g.key for g in request.groups if g.due}
    segments, versions = 0, []
    # every group sent has an unfinished member: before the first segment none is complete
    done = batch_done(set(), due, request.need, sum(len(g.members) for g in request.groups), 0, request.min_steps)
    while not done:
        interrupted = False
        before = _tokens(session.records)
        try:
            session.step(request.segment_tokens, version=version, should_stop=should_stop)
        except GenerationInterrupted:
            interrupted = True
        segments += 1
        versions.append(int(version))
        state = (interrupted, _complete_keys(mine, session.records), session.running, _tokens(session.records) - before)
        states = _gather(state, group) if distributed else [state]
        if any(s[0] for s in states):
            session.close()
            raise GenerationInterrupted(f"partial generation batch {request.key!r} interrupted after {segments} "
                                        "segments")
        running = sum(s[2] for s in states)
        if running and not any(s[3] for s in states):
            session.close()
            raise RuntimeError(f"partial generation batch {request.key!r}: segment {segments} added no token to the "
                               f"{running} running records; the engine ({type(engine).__name__}) lost them")
        done = batch_done(set().union(*(s[1] for s in states)), due, request.need, running,
                          segments * request.segment_tokens, request.min_steps)
        if not done and between_segments is not None:
            try:
                version = between_segments(segments, version)
            except BaseException:
                session.close()
                raise
    records = session.close()
    sent = records if rank % rollout_tp == 0 else None
    parts = [p for p in (_gather(sent, group) if distributed else [sent])[::rollout_tp]]
    flat = [r for part in parts for r in part]
    members, k = [], 0
    for g in request.groups:
        members.append(flat[k:k + len(g.members)])
        k += len(g.members)
    return PartialOutput(members, segments, versions)


def _tokens(records: list[SequenceRecord]) -> int:
    return sum(len(r.token_ids) for r in records)


def _complete_keys(groups: list[GroupWork], records: list[SequenceRecord]) -> set:
    done, k = set(), 0
    for g in groups:
        if all(r.finished for r in records[k:k + len(g.members)]):
            done.add(g.key)
        k += len(g.members)
    return done


def _gather(obj, group):
    from mcpo_megatron.parallel.distributed import all_gather_objects

    return all_gather_objects(obj, group=group)
