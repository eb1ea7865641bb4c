"""How long the trainer waits for engines on ranks of their own (``rollout.placement=separate``), and how it
learns that an engine rank stopped working.

Every wait on the engines is bounded by the config:

* ``rollout.batch_timeout_s``: the longest one generation batch may take on the engines (the weight update before
  it included). The engines report, with each heartbeat, how long they have worked on their current batch; the
  trainer leader raises when that passes the limit (an engine rank alive but making no progress).
* ``rollout.heartbeat_timeout_s``: each engine rank's :class:`Heartbeat` thread writes a beat into the launch's
  store every :attr:`Waits.beat_period_s`; the trainer leader (:class:`EngineWatch`) raises, naming the engine
  ranks whose beats stopped (a rank that died, froze, or lost its network).
* the collective timeouts of the ranks that wait while another waits on the engines derive from the batch
  limit (:class:`Waits`): the other trainer ranks wait for the leader in a gloo group of their own
  (``RemoteRollouts``); engine replicas wait for each other within a batch in the engine world.

How everyone learns of a failure: the leader's error travels to every trainer rank in the broadcast they are
waiting in (``RemoteRollouts.result`` / ``publish``), so every trainer rank raises the same error and exits
non-zero; the launcher then ends the engine ranks (torchrun's agent stops every worker when one fails; srun
with ``--kill-on-bad-exit=1``, as ``slurm/`` launches, ends the job step). An engine rank that is still alive is
also told to stop through the store.
"""

from __future__ import annotations

import pickle
import threading
import time
from dataclasses import dataclass
from typing import Callable

# Engine start-up (building vLLM, capturing CUDA graphs) takes time no batch limit covers: the fixed collective
# timeout every group had before.
SLACK_S = 1800.0


class EnginesFailed(RuntimeError):
    """An engine rank stopped beating, or the engines exceeded a configured wait."""


@dataclass(frozen=True)
class Waits:
    """The configured limits and the timeouts derived from them (seconds)."""

    batch_s: float        # rollout.batch_timeout_s
    heartbeat_s: float    # rollout.heartbeat_timeout_s
    batches_queued: int   # the most batches the engines may work through while the trainer waits for one
    slack_s: float = SLACK_S

    @classmethod
    def from_config(cls, cfg) -> "Waits":
        """A batch the trainer waits for can queue behind the ``trainer.max_staleness`` batches submitted ahead and
        a retention probe (DAPO's extra batches and evaluation are submitted after them): max_staleness + 2
        batches, itself included."""
        return cls(float(cfg.rollout.batch_timeout_s), float(cfg.rollout.heartbeat_timeout_s),
                   int(cfg.trainer.max_staleness) + 2)

    @property
    def leader_s(self) -> float:
        """The longest the trainer leader waits for one result, or to stage a version, before it gives up."""
        return self.batches_queued * self.batch_s + self.slack_s

    @property
    def trainer_group_s(self) -> float:
        """The timeout of the group the other trainer ranks wait in meanwhile: longer than the leader's wait, so
        the leader's verdict (a result or an error) reaches them before their collective times out."""
        return self.leader_s + self.slack_s

    @property
    def engine_world_s(self) -> float:
        """The engine world's collective timeout: within a batch a replica waits for the slowest one."""
        return self.batch_s + self.slack_s

    @property
    def beat_period_s(self) -> float:
        """How often an engine rank beats: several beats per heartbeat timeout, at most every 5 s."""
        return min(5.0, self.heartbeat_s / 4)


@dataclass(frozen=True)
class Beat:
    """What an engine rank's heartbeat writes: a counter, and the batch it works on (None: idle) for how long."""

    count: int
    batch: str | None = None
    busy_s: float = 0.0


def beat_key(bridge_rank: int) -> str:
    return f"hb/{bridge_rank}"


class Heartbeat:
    """An engine rank's heartbeat: a daemon thread that writes a :class:`Beat` under ``hb/<bridge rank>`` in the
    launch's store every ``period_s``, over a store connection of its own. The rank's serving loop marks the
    batch it works on (:meth:`busy` / :meth:`idle`).

    The thread beats as long as the process runs and reaches the store: it shows the rank is alive, not that its
    main thread progresses (a main thread stuck in a collective keeps beating); the batch limit covers that.
    """

    def __init__(self, store, bridge_rank: int, period_s: float):
        self.store, self.key, self.period_s = store, beat_key(bridge_rank), float(period_s)
        self._count = 0
        self._busy: tuple[str, float] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mcpo-engine-heartbeat", daemon=True)
        self._thread.start()

    def busy(self, batch) -> None:
        """This rank starts working on ``batch`` (reported with the next beat)."""
        self._busy = (repr(batch), time.monotonic())

    def idle(self) -> None:
        self._busy = None

    def _beat(self) -> None:
        busy = self._busy
        self._count += 1
        beat = Beat(self._count) if busy is None else Beat(self._count, busy[0], time.monotonic() - busy[1])
        self.store.set(self.key, pickle.dumps(beat))

    def _run(self) -> None:  # only this thread writes to its store connection
        while not self._stop.is_set():
            self._beat()
            self._stop.wait(self.period_s)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(self.period_s + 5)


class EngineWatch:
    """The trainer leader's view of the engine ranks' heartbeats; :meth:`check` raises :class:`EnginesFailed`.

    A rank is silent when its beat counter has not changed for ``heartbeat_s`` of the leader's own clock (clocks
    of other machines are never compared). The leader reads the beats only while it waits on the engines; after
    a pause (the trainer trained), a changed counter counts as fresh, an unchanged one as silent since the last
    look, so a silence is named at most ``heartbeat_s`` (plus one look) after the leader starts waiting.
    """

    def __init__(self, store, engine_names: dict[int, str], waits: Waits, *,
                 clock: Callable[[], float] = time.monotonic):
        self.store, self.names, self.waits, self.clock = store, dict(engine_names), waits, clock
        self.look_every_s = min(1.0, waits.heartbeat_s / 4)
        now = clock()
        self._count: dict[int, int | None] = {r: None for r in self.names}
        self._seen: dict[int, float] = {r: now for r in self.names}
        self._busy: dict[int, Beat] = {}
        self._looked = -float("inf")

    def _read(self, rank: int) -> Beat | None:
        key = beat_key(rank)
        return pickle.loads(self.store.get(key)) if self.store.check([key]) else None

    def look(self) -> None:
        """Read every engine rank's beat (rate-limited to one look per ``look_every_s``)."""
        now = self.clock()
        if now - self._looked < self.look_every_s:
            return
        self._looked = now
        for rank in self.names:
            beat = self._read(rank)
            if beat is not None and beat.count != self._count[rank]:
                self._count[rank], self._seen[rank] = beat.count, now
                self._busy[rank] = beat

    def check(self, waiting_for: str, since: float | None = None) -> None:
        """Raise :class:`EnginesFailed` when an engine rank is silent, has worked on one batch for longer than
        the batch limit, or (with ``since``, the leader's clock when its wait began) the wait itself has lasted
        longer than :attr:`Waits.leader_s`."""
        self.look()
        now, w = self.clock(), self.waits
        silent = [r for r in self.names if now - self._seen[r] > w.heartbeat_s]
        if silent:
            names = ", ".join(f"{self.names[r]} (silent {now - self._seen[r]:.0f} s)" for r in silent)
            raise EnginesFailed(
                f"{names}: no heartbeat for longer than rollout.heartbeat_timeout_s={w.heartbeat_s:g} while the "
                f"trainer waited for {waiting_for}; the rank died, froze or lost its network: its log (and the "
                f"node's) says which. Every trainer rank stops here; the launcher ends the engine ranks")
        slow = {r: b for r, b in self._busy.items() if b.batch is not None and b.busy_s > w.batch_s}
        if slow:
            names = ", ".join(f"{self.names[r]} on generation batch {b.batch} for {b.busy_s:.0f} s"
                              for r, b in slow.items())
            raise EnginesFailed(
                f"{names}: longer than rollout.batch_timeout_s={w.batch_s:g} (the ranks are alive: they send "
                f"heartbeats, but make no progress, e.g. stuck in a collective); raise rollout.batch_timeout_s if "
                f"batches this long are expected")
        if since is not None and now - since > w.leader_s:
            raise EnginesFailed(
                f"waited {now - since:.0f} s for {waiting_for}: longer than the {w.batches_queued} generation "
                f"batches that can be ahead of it may take at rollout.batch_timeout_s={w.batch_s:g} (plus "
                f"{w.slack_s:g} s for start-up); the engine ranks send heartbeats but deliver "
                f"nothing: their logs say where they stand")


def engine_names(roles) -> dict[int, str]:
    """``{bridge rank: name}`` of the engine ranks, named by engine rank and launch rank (what logs show)."""
    trainers = roles.global_size - roles.rollout_ranks
    return {trainers + i: f"engine rank {i} (launch rank {trainers + i})" for i in range(roles.rollout_ranks)}
