"""Entry point of a reward worker process (started with the ``spawn`` method).

Protocol over one duplex pipe:
  worker -> parent: ``("ready", pid)`` once imports and a warm-up are done, or ``("fatal", text)``;
  parent -> worker: ``("batch", [(idx, response, gold, answer_format), ...])`` or ``None`` (exit);
  worker -> parent: ``("res", idx, correct, status, extracted)`` after each item, in order, so the
  parent can restart the per-item deadline at every result and knows which item hung.
"""

from __future__ import annotations

import resource
import traceback

from mcpo_megatron.helper_signals import ignore_scheduler_signals


PARENT_CHECK_S = 2.0  # how often an idle worker checks that the process that started it is alive


def _limit_memory(memory_mb: int) -> None:
    if memory_mb and memory_mb > 0:
        limit = int(memory_mb) << 20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def worker_main(conn, memory_mb: int) -> None:
    """Serve scoring batches until told to exit or the pipe closes."""
    # The scheduler's signals are the trainer's (helper_signals): a worker they killed would score its items
    # "crashed" in the very step the trainer finishes and checkpoints. The pool stops workers with a message or
    # SIGKILL, and closes them at exit before multiprocessing would terminate them.
    ignore_scheduler_signals()
    try:
        _limit_memory(memory_mb)
        from mcpo_megatron.rewards.verify import score_one

        score_one("Answer: 1", "1", "dapo")  # warm-up: lazy imports and regex compilation
    except BaseException:  # noqa: BLE001  report anything, the parent raises a clear error
        try:
            conn.send(("fatal", traceback.format_exc()))
        except BaseException:  # noqa: BLE001  e.g. MemoryError under a tiny RLIMIT_AS: the parent sees EOF
            pass
        return
    import os

    parent = os.getppid()
    conn.send(("ready", os.getpid()))
    while True:
        try:
            # A parent killed with SIGKILL may leave a copy of its pipe end open in another process (e.g. a
            # forked helper), so EOF is not guaranteed: also exit once this process has been re-parented.
            while not conn.poll(PARENT_CHECK_S):
                if os.getppid() != parent:
                    return
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        _, items = msg
        for idx, response, gold, answer_format in items:
            try:
                correct, status, extracted = score_one(response, gold, answer_format)
            except Exception:  # noqa: BLE001  MemoryError, RecursionError, sympy bugs
                correct, status, extracted = 0, "crashed", None
            conn.send(("res", idx, correct, status, extracted))
