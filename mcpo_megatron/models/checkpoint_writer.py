"""megatron-core's checkpoint writer, started so that the scheduler's signals leave it alone.

``dist_checkpointing.save`` (the ``torch_dist`` strategy's ``FileSystemWriterAsync``) hands each save's results
through a ``multiprocessing`` Manager queue that it creates at the first save and keeps for the life of the
process. The Manager is a spawned process with the default signal actions, so the preemption signal that SLURM
delivers to every process of the step kills it, and the very save the rank makes on that signal fails with a
``BrokenPipeError``: the run loses every step since the last periodic checkpoint. :func:`start_checkpoint_writer`
creates that queue first, on a Manager that ignores the scheduler's signals (helper_signals); megatron then uses
it for every save.

It sets a private variable of megatron-core 0.16.1's ``filesystem_async`` module (``_results_queue``, read by its
``_get_write_results_queue``); tests/models/test_checkpoint_writer.py fails if that contract changes.
"""

from __future__ import annotations

import multiprocessing as mp
from multiprocessing.managers import SyncManager

from mcpo_megatron.helper_signals import ignore_scheduler_signals

_manager: SyncManager | None = None


def start_checkpoint_writer() -> None:
    """Make megatron's checkpoint writer's Manager one that ignores the scheduler's signals (idempotent; call
    before the first ``dist_checkpointing.save`` of the process)."""
    global _manager
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is not None:
        return
    manager = SyncManager(ctx=mp.get_context("spawn"))  # the context megatron uses for it
    manager.start(initializer=ignore_scheduler_signals)
    filesystem_async._results_queue = manager.Queue()
    _manager = manager

