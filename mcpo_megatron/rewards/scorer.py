"""A pool of killable math-verify worker processes that never blocks past its deadlines.

Why processes: math-verify's ``signal.alarm`` timeouts only work in a main thread and cannot
interrupt C-level work (``\\boxed{9^{9^{9^9}}}`` makes sympy/GMP build an integer with
billions of digits and never return; Math-Verify issue #65). So each worker runs with its
internal timeouts disabled and an address-space cap (RLIMIT_AS), and the parent enforces a
wall-clock deadline per item: a worker that overruns is killed and replaced, the item scores
as incorrect with status ``timeout``; a worker that dies scores its item ``crashed``.

Throughput: items travel in small batches (one pipe round trip per batch); the worker sends
a result after each item, which restarts that item's successor's deadline, so a batch never
stretches one item's budget. Responses are cut to their last 1,000 characters in the parent
(all the verifier reads), so a 100k-character response costs nothing to ship.
"""

from __future__ import annotations

import atexit
import math
import multiprocessing as mp
import threading
import time
from collections import Counter, deque
from multiprocessing.connection import wait as wait_connections
from typing import Sequence

from mcpo_megatron.helper_processes import (UNGUARDED_MAIN_EXIT, close_at_exit, refuse_in_bootstrap,
                                            unguarded_main_advice)
from mcpo_megatron.rewards.extract import response_tail
from mcpo_megatron.rewards.types import STATUSES, Grading, RewardResult
from mcpo_megatron.rewards.worker import worker_main

_MAX_STARTUP_FAILURES = 3
# The smallest address-space cap a worker starts under (16 MiB failed to import math-verify, 64 MiB started); the
# config's reward.memory_mb has the same rule.
MIN_MEMORY_MB = 64


def _unguarded_main_advice() -> str:
    return unguarded_main_advice("the reward workers are started", "a MathVerifyScorer (or trains)",
                                 "scores or trains")


class RewardPoolError(RuntimeError):
    """The reward workers cannot be started (e.g. math-verify missing or memory_mb too small)."""


class _Worker:
    """One worker process and the parent's view of it."""

    def __init__(self, ctx, memory_mb: int):
        parent_conn, child_conn = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(
            target=worker_main, args=(child_conn, memory_mb), name="mcpo-reward-worker", daemon=True
        )
        self.proc.start()
        child_conn.close()  # the parent keeps only its end, so EOF signals the worker's death
        self.conn = parent_conn
        self.ready = False
        self.started_at = time.monotonic()
        self.inflight: deque[int] = deque()
        self.deadline = math.inf

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=10)
        self.conn.close()

    def stop(self) -> None:
        """Ask the worker to exit; kill it if it does not within a second."""
        try:
            self.conn.send(None)
        except (OSError, ValueError):
            pass
        self.proc.join(timeout=1.0)
        self.kill()


def _check(name: str, value, ok: bool, rule: str) -> None:
    if not ok:
        raise ValueError(f"MathVerifyScorer: {name}={value!r} is invalid: {rule}. Pass a value that satisfies it.")


class MathVerifyScorer:
    """Score math responses against gold answers with math-verify in killable worker processes.

    Use as a context manager (or call :meth:`close`). :meth:`score` may be called from any
    thread; calls are serialised. Every call returns within roughly
    ``min(total_timeout, sum of per-item deadlines)``: a hanging item costs at most
    ``timeout_s`` plus a respawn, and items still unscored when the total budget runs out
    are returned as ``timeout``.

    Args:
        num_workers: worker processes (one per core reserved for rewards).
        timeout_s: wall-clock deadline per item (spec: 10 s).
        memory_mb: RLIMIT_AS of each worker in MiB (0 disables the cap; else at least MIN_MEMORY_MB).
        grading: the answer format and the two rewards (:class:`~mcpo_megatron.rewards.types.Grading`).
        total_timeout_s: bound on one :meth:`score` call; default
            ``max(60, 3 * timeout_s) + 0.5 s * ceil(n / num_workers)``.
        chunk_size: most items per worker round trip.
        startup_timeout_s: time a fresh worker may take to import math-verify.
        spare: keep one extra worker started and idle, so a killed worker is replaced at once
            instead of after a fresh spawn (about 1 s of imports; more on a loaded machine).
    """

    def __init__(
        self,
        num_workers: int = 2,
        timeout_s: float = 10.0,
        memory_mb: int = 2048,
        *,
        grading: Grading = Grading(),
        total_timeout_s: float | None = None,
        chunk_size: int = 16,
        startup_timeout_s: float = 120.0,
        spare: bool = True,
    ):
        refuse_in_bootstrap(f"a reward worker could not start: {_unguarded_main_advice()}")
        _check("num_workers", num_workers, isinstance(num_workers, int) and num_workers >= 1, "must be an int >= 1")
        _check("timeout_s", timeout_s, math.isfinite(timeout_s) and timeout_s > 0,
               "must be a finite number > 0 of seconds")
        _check("memory_mb", memory_mb, memory_mb == 0 or memory_mb >= MIN_MEMORY_MB,
               f"must be 0 (no cap) or >= {MIN_MEMORY_MB} (a size in MiB; a worker cannot import math-verify in "
               "less; 2048 is the default)")
        _check("total_timeout_s", total_timeout_s, total_timeout_s is None or total_timeout_s > 0, "must be > 0 or None")
        _check("chunk_size", chunk_size, isinstance(chunk_size, int) and chunk_size >= 1, "must be an int >= 1")
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        self.memory_mb = int(memory_mb)
        self.grading = grading
        self.total_timeout_s = total_timeout_s
        self.chunk_size = chunk_size
        self.startup_timeout_s = float(startup_timeout_s)
        #: Cumulative counts over the scorer's life: one key per status, plus "respawns".
        self.counters: Counter = Counter({s: 0 for s in STATUSES})
        self.counters["respawns"] = 0
        #: Longest wall time of any single item seen (seconds), including killed ones.
        self.max_item_seconds = 0.0
        self._ctx = mp.get_context("spawn")
        self._lock = threading.Lock()
        self._closed = False
        self._startup_failures = 0
        self._workers = [_Worker(self._ctx, self.memory_mb) for _ in range(num_workers)]
        self._spare: _Worker | None = _Worker(self._ctx, self.memory_mb) if spare else None
        # Workers ignore SIGTERM (helper_signals), which multiprocessing's own exit hook sends its daemon children
        # before joining them: stop them first (exit hooks run last registered, first run).
        self._close_at_exit = close_at_exit(self)

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> "MathVerifyScorer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop all workers (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            atexit.unregister(self._close_at_exit)
            for w in self._workers + ([self._spare] if self._spare is not None else []):
                w.stop()
            self._workers = []
            self._spare = None

    def __del__(self):  # best effort; daemon workers also die with the parent
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Block until every worker finished importing math-verify (optional; score() waits too)."""
        with self._lock:
            deadline = time.monotonic() + (self.startup_timeout_s if timeout_s is None else timeout_s)
            while not all(w.ready for w in self._workers):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RewardPoolError(f"reward workers not ready after {timeout_s} s")
                conns = [w.conn for w in self._workers if not w.ready]
                for conn in wait_connections(conns, timeout=left):
                    self._receive(self._by_conn(conn), None, None)

    # ------------------------------------------------------------------ scoring
    def score(
        self,
        responses: Sequence[str],
        golds: Sequence[str],
        truncated: Sequence[bool] | None = None,
    ) -> list[RewardResult]:
        """Score ``responses[i]`` against ``golds[i]``; ``truncated[i]`` marks overlong responses."""
        n = len(responses)
        if len(golds) != n:
            raise ValueError(f"score: len(golds)={len(golds)} must equal len(responses)={n}; pass one gold per response")
        if truncated is not None and len(truncated) != n:
            raise ValueError(
                f"score: len(truncated)={len(truncated)} must equal len(responses)={n}; pass one flag per response or None"
            )
        for i, (r, g) in enumerate(zip(responses, golds)):
            if not isinstance(r, str) or not isinstance(g, str):
                raise TypeError(f"score: responses[{i}] and golds[{i}] must be str, got {type(r).__name__}, {type(g).__name__}")
        flags = [bool(t) for t in truncated] if truncated is not None else [False] * n
        if n == 0:
            return []
        with self._lock:
            if self._closed:
                raise RuntimeError("MathVerifyScorer.score called after close(); create a new scorer")
            raw = self._run([response_tail(r) for r in responses], list(golds))
        out = []
        for (correct, status, extracted), flag in zip(raw, flags):
            self.counters[status] += 1
            out.append(RewardResult(score=self.grading.score(correct), correct=int(correct), status=status, extracted=extracted, truncated=flag))
        return out

    # ------------------------------------------------------------------ internals
    def _by_conn(self, conn) -> _Worker:
        for w in self._workers:
            if w.conn is conn:
                return w
        raise KeyError(conn)

    def _replace(self, w: _Worker) -> None:
        """Kill ``w``; the spare (already importing or ready) takes its place and a new spare starts."""
        w.kill()
        self.counters["respawns"] += 1
        fresh = _Worker(self._ctx, self.memory_mb)
        if self._spare is not None and self._spare.proc.is_alive():
            fresh, self._spare = self._spare, fresh
            fresh.started_at = time.monotonic()  # its startup clock runs from its promotion
        elif self._spare is not None:
            self._spare.kill()
            self._spare = _Worker(self._ctx, self.memory_mb)
        self._workers[self._workers.index(w)] = fresh

    def _fail_item(self, w: _Worker, results, pending: deque, status: str) -> None:
        """The worker's current item gets ``status``; its other items go back to the queue."""
        now = time.monotonic()
        if w.inflight:
            idx = w.inflight.popleft()
            results[idx] = (0, status, None)
            self.max_item_seconds = max(self.max_item_seconds, now - (w.deadline - self.timeout_s))
            pending.extendleft(reversed(w.inflight))
            w.inflight.clear()
        self._replace(w)

    def _startup_failed(self, w: _Worker, detail: str) -> None:
        self._startup_failures += 1
        self._replace(w)
        if self._startup_failures >= _MAX_STARTUP_FAILURES:
            raise RewardPoolError(
                f"reward workers failed to start {self._startup_failures} times in a row "
                f"(memory_mb={self.memory_mb}); last error:\n{detail}"
            )

    def _receive(self, w: _Worker, results, pending) -> None:
        """Drain every message the worker has sent; handle its death."""
        while True:
            try:
                if not w.conn.poll():
                    return
                msg = w.conn.recv()
            except (EOFError, OSError):
                if not w.ready:
                    w.proc.join(timeout=5)
                    if w.proc.exitcode == UNGUARDED_MAIN_EXIT:
                        self._replace(w)
                        raise RewardPoolError(f"reward workers cannot start: {_unguarded_main_advice()}")
                    self._startup_failed(w, f"worker pid {w.proc.pid} exited during startup "
                                            f"(exit code {w.proc.exitcode})")
                else:
                    self._fail_item(w, results, pending, "crashed")
                return
            kind = msg[0]
            if kind == "ready":
                w.ready = True
                self._startup_failures = 0
            elif kind == "fatal":
                self._startup_failed(w, msg[1])
                return
            elif kind == "res":
                _, idx, correct, status, extracted = msg
                now = time.monotonic()
                if not w.inflight or w.inflight[0] != idx:  # protocol confusion: start over cleanly
                    self._fail_item(w, results, pending, "crashed")
                    return
                w.inflight.popleft()
                results[idx] = (correct, status, extracted)
                self.max_item_seconds = max(self.max_item_seconds, now - (w.deadline - self.timeout_s))
                w.deadline = now + self.timeout_s if w.inflight else math.inf

    def _budget(self, n: int) -> float:
        if self.total_timeout_s is not None:
            return self.total_timeout_s
        return max(60.0, 3.0 * self.timeout_s) + 0.5 * math.ceil(n / self.num_workers)

    def _run(self, tails: list[str], golds: list[str]) -> list[tuple[int, str, str | None]]:
        n = len(tails)
        results: list = [None] * n
        pending: deque[int] = deque(range(n))
        end = time.monotonic() + self._budget(n)
        chunk = max(1, min(self.chunk_size, math.ceil(n / (2 * self.num_workers))))
        fmt = self.grading.answer_format
        done = lambda: not pending and not any(w.inflight for w in self._workers)  # noqa: E731
        while not done():
            now = time.monotonic()
            if now >= end:  # total budget spent: never hold the trainer longer
                for w in list(self._workers):
                    if w.inflight:
                        for idx in w.inflight:
                            results[idx] = (0, "timeout", None)
                        w.inflight.clear()
                        self._replace(w)
                for idx in pending:
                    results[idx] = (0, "timeout", None)
                pending.clear()
                break
            for w in list(self._workers):
                if w.ready and not w.inflight and not w.proc.is_alive():  # died while idle: no item to blame
                    self._replace(w)
                    continue
                if w.ready and not w.inflight and pending:
                    batch = [pending.popleft() for _ in range(min(chunk, len(pending)))]
                    w.inflight = deque(batch)
                    w.deadline = now + self.timeout_s
                    try:
                        w.conn.send(("batch", [(i, tails[i], golds[i], fmt) for i in batch]))
                    except (OSError, ValueError):
                        self._fail_item(w, results, pending, "crashed")
            watch = [w for w in self._workers if w.inflight or not w.ready]
            wake = [end] + [w.deadline for w in watch if w.inflight]
            wake += [w.started_at + self.startup_timeout_s for w in watch if not w.ready]
            timeout = max(0.0, min(wake) - time.monotonic())
            for conn in wait_connections([w.conn for w in watch], timeout=timeout):
                self._receive(self._by_conn(conn), results, pending)
            now = time.monotonic()
            for w in list(self._workers):
                if w.inflight and now >= w.deadline:
                    self._fail_item(w, results, pending, "timeout")
                elif not w.ready and now >= w.started_at + self.startup_timeout_s:
                    self._startup_failed(w, f"worker not ready after {self.startup_timeout_s} s")
        return results
