"""The trainer's side of partial rollouts: the prompts drawn and not yet trained, as groups of sequence records
(docs/algorithms.md §13, docs/decisions.md, "Partial rollouts").

Each generation batch (:meth:`RolloutPool.assemble`) for training step ``step``:

1. drops, from the groups waiting in the pool, every record whose oldest token would be more than
   ``max_staleness`` versions old at ``step`` (it starts again from its prompt, with its seed; counted);
2. draws new prompts until the pool holds ``batch_groups + spare_groups`` groups (W + S) besides the groups
   other batches generate;
3. reserves for the batch the complete groups waiting in the pool (at most W), so the batch needs
   ``W - reserved`` more;
4. sends every incomplete group waiting in the pool, with its unfinished members; with
   ``staleness_policy="wait"`` a group whose oldest token would be too stale at the next step is *due*: the batch
   does not end before it is complete.

The engines end the batch once ``need`` of its groups are complete and every due group is
(``segments.batch_done``). :meth:`RolloutPool.absorb` takes the records back and :meth:`RolloutPool.take`
hands out exactly W complete groups, the reserved ones first, then due ones, then the oldest; complete groups
beyond W and the unfinished ones stay for the next batch. So a group trains only once all its members finished,
each prompt drawn is trained exactly once (or is still in the pool), and no trained record has a token more than
``max_staleness`` versions old. Pure Python: no engine, no process group.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

from mcpo_megatron.rollout.engines.interface import sample_seed
from mcpo_megatron.rollout.engines.records import SequenceRecord
from mcpo_megatron.rollout.partial.segments import GroupWork, PartialOutput

STALENESS_POLICIES = ("wait", "drop")


@dataclass
class PoolGroup:
    """A prompt's ``group_size`` records in the pool."""

    gid: int                               # order of entry into the pool
    prompt_index: int                      # the prompt's index in the data set
    members: list[SequenceRecord]
    in_flight: Any = None                  # the key of the batch generating it, or None
    reserved: Any = None                   # complete, and reserved for the take of that batch

    @property
    def complete(self) -> bool:
        return all(r.finished for r in self.members)

    @property
    def oldest_version(self) -> int | None:
        versions = [r.oldest_version for r in self.members if r.versions]
        return min(versions) if versions else None


@dataclass
class BatchFigures:
    """What assembling a batch did to the pool, for the step's record."""

    new_groups: int = 0                    # prompts drawn into the pool
    due_groups: int = 0                    # groups the batch had to complete (staleness_policy=wait)
    dropped_sequences: int = 0             # records restarted for staleness
    dropped_tokens: int = 0                # their tokens


@dataclass
class _Batch:
    """A batch assembled and not yet taken."""

    step: int
    gids: list[int]                        # the groups sent, in order
    reserved: list[int]                    # complete groups it takes first
    due: list[int]
    need: int
    figures: BatchFigures


class RolloutPool:
    """The groups drawn and not yet trained (module docstring). ``draw()`` returns the next prompts of the data
    order (the sampler's next batch); ``prompt_of(index)`` a prompt's token ids."""

    def __init__(self, *, group_size: int, batch_groups: int, spare_groups: int, max_staleness: int,
                 staleness_policy: str, draw: Callable[[], list[int]], prompt_of: Callable[[int], list[int]]):
        if staleness_policy not in STALENESS_POLICIES:
            raise ValueError(f"staleness_policy={staleness_policy!r} must be one of {STALENESS_POLICIES}")
        if group_size < 1 or batch_groups < 1 or spare_groups < 0 or max_staleness < 0:
            raise ValueError(f"RolloutPool: group_size={group_size}, batch_groups={batch_groups} must be >= 1 and "
                             f"spare_groups={spare_groups}, max_staleness={max_staleness} >= 0")
        self.group_size, self.batch_groups, self.spare_groups = group_size, batch_groups, spare_groups
        self.max_staleness, self.policy = max_staleness, staleness_policy
        self.draw, self.prompt_of = draw, prompt_of
        self.backlog: list[int] = []       # prompts drawn from the data order, not yet in the pool
        self.groups: dict[int, PoolGroup] = {}
        self.next_gid = 0
        self.batches: dict[Any, _Batch] = {}

    # ------------------------------------------------------------------ a generation batch
    def assemble(self, key, step: int, batch_seed: int) -> tuple[list[GroupWork], int]:
        """The groups of generation batch ``key`` for training step ``step`` and the number of them that must be
        complete (module docstring). New groups' samples are seeded with ``sample_seed(batch_seed, position among
        the batch's new prompts, sample)``, as a batch of those prompts is without partial rollouts."""
        if key in self.batches:
            raise ValueError(f"generation batch {key!r} was already assembled")
        figures = BatchFigures()
        waiting = [g for g in self.groups.values() if g.in_flight is None and g.reserved is None]
        for g in waiting:
            self._drop_stale(g, step, figures)
        fresh = [self._new_group(position, batch_seed)
                 for position in range(max(0, self.batch_groups + self.spare_groups - len(waiting)))]
        figures.new_groups = len(fresh)
        due = {g.gid for g in waiting + fresh if self._due(g, step)}
        complete = sorted((g for g in waiting if g.complete), key=lambda g: (g.gid not in due, g.gid))
        reserved = [g.gid for g in complete[: self.batch_groups]]
        sent = [g for g in waiting + fresh if not g.complete]
        for gid in reserved:
            self.groups[gid].reserved = key
        for g in sent:
            g.in_flight = key
        need = self.batch_groups - len(reserved)
        due_sent = sorted(due & {g.gid for g in sent})
        figures.due_groups = len(due_sent)
        self.batches[key] = _Batch(step, [g.gid for g in sent], reserved, due_sent, need, figures)
        return self.work(key), need

    def work(self, key) -> list[GroupWork]:
        """The groups batch ``key`` generates, each with its unfinished members (as sent: also after a resume)."""
        b = self.batches[key]
        return [GroupWork(gid, list(self.prompt_of(self.groups[gid].prompt_index)),
                          [r for r in self.groups[gid].members if not r.finished], gid in b.due) for gid in b.gids]

    def need(self, key) -> int:
        return self.batches[key].need

    def absorb(self, key, output: PartialOutput) -> None:
        """The records batch ``key`` generated, into their groups."""
        b = self.batches[key]
        if len(output.members) != len(b.gids):
            raise ValueError(f"generation batch {key!r}: {len(output.members)} groups back for {len(b.gids)} sent")
        for gid, records in zip(b.gids, output.members):
            g = self.groups[gid]
            unfinished = [k for k, r in enumerate(g.members) if not r.finished]
            if len(records) != len(unfinished):
                raise ValueError(f"generation batch {key!r}: group {gid} sent {len(unfinished)} records, got "
                                 f"{len(records)} back")
            for k, r in zip(unfinished, records):
                g.members[k] = r
            g.in_flight = None

    def take(self, key) -> tuple[list[PoolGroup], BatchFigures]:
        """Exactly ``batch_groups`` complete groups for batch ``key``'s step (the reserved ones, then those due,
        then the oldest), out of the pool, and the figures of the batch's assembly."""
        b = self.batches.pop(key)
        done = [gid for gid in b.gids if self.groups[gid].complete]
        done.sort(key=lambda gid: (gid not in b.due, gid))
        taken = (b.reserved + done)[: self.batch_groups]
        if len(taken) < self.batch_groups:
            raise RuntimeError(f"generation batch {key!r} ended with {len(taken)} complete groups; "
                               f"{self.batch_groups} were needed")
        for gid in b.reserved:
            self.groups[gid].reserved = None
        groups = [self.groups.pop(gid) for gid in taken]
        for g in groups:
            oldest = g.oldest_version
            if oldest is not None and b.step - oldest > self.max_staleness:
                raise RuntimeError(f"group of prompt {g.prompt_index} would train at step {b.step} with a token of "
                                   f"version {oldest}: more than max_staleness={self.max_staleness} versions old")
        return groups, b.figures

    # ------------------------------------------------------------------ the rules
    def _drop_stale(self, g: PoolGroup, step: int, figures: BatchFigures) -> None:
        """Records with a token more than max_staleness versions old at ``step`` start again (both policies: with
        ``wait`` only when more groups were due at once than a step trains)."""
        for k, r in enumerate(g.members):
            if r.versions and step - r.oldest_version > self.max_staleness:
                figures.dropped_sequences += 1
                figures.dropped_tokens += len(r.token_ids)
                g.members[k] = r.restarted()

    def _due(self, g: PoolGroup, step: int) -> bool:
        """``wait``: the group must be trained at ``step``, since at any later step its oldest token would be more
        than max_staleness versions old."""
        oldest = g.oldest_version
        return self.policy == "wait" and oldest is not None and step + 1 - oldest > self.max_staleness

    def _new_group(self, position: int, batch_seed: int) -> PoolGroup:
        if not self.backlog:
            self.backlog = list(self.draw())
        prompt = self.backlog.pop(0)
        g = PoolGroup(self.next_gid, prompt, [SequenceRecord(prompt, i, sample_seed(batch_seed, position, i))
                                             for i in range(self.group_size)])
        self.groups[g.gid] = g
        self.next_gid += 1
        return g

    # ------------------------------------------------------------------ what it holds
    @property
    def unfinished_records(self) -> int:
        return sum(not r.finished for g in self.groups.values() for r in g.members)

    def state_dict(self) -> dict:
        """Everything, as plain values and tensors (a copy: the pool goes on changing)."""
        return {
            "backlog": list(self.backlog), "next_gid": self.next_gid,
            "groups": [{"gid": g.gid, "prompt_index": g.prompt_index, "in_flight": g.in_flight,
                        "reserved": g.reserved, "members": [r.state_dict() for r in g.members]}
                       for g in self.groups.values()],
            "batches": [{"key": k, "step": b.step, "gids": list(b.gids), "reserved": list(b.reserved),
                         "due": list(b.due), "need": b.need, "figures": dataclasses.asdict(b.figures)}
                        for k, b in self.batches.items()],
        }

    def load_state_dict(self, state: dict) -> None:
        self.backlog = [int(i) for i in state["backlog"]]
        self.next_gid = int(state["next_gid"])
        self.groups = {}
        for row in state["groups"]:
            g = PoolGroup(int(row["gid"]), int(row["prompt_index"]),
                          [SequenceRecord.from_state(m) for m in row["members"]],
                          _key(row["in_flight"]), _key(row["reserved"]))
            self.groups[g.gid] = g
        self.batches = {_key(row["key"]): _Batch(int(row["step"]), list(row["gids"]), list(row["reserved"]),
                                                 list(row["due"]), int(row["need"]), BatchFigures(**row["figures"]))
                        for row in state["batches"]}


def _key(value):
    """A batch key back from a checkpoint (a list where a tuple was saved)."""
    return tuple(value) if isinstance(value, list) else value

