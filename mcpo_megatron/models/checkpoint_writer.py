"""megatron-core's checkpoint writer, started so that the scheduler's signals leave it alone.

``dist_checkpointing.save`` (the ``torch_dist`` strategy's ``FileSystemWriterAsync``) hands each save's results
through a ``multiprocessing`` Manager queue that it creates at the first save and keeps for the life of the
process. The Manager is a spawned process with the default signal actions, so the preemption signal that SLURM
delivers to every process of the step kills it, and the very save the rank makes on that signal fails with a
``BrokenPipeError``: the run loses every step since the last periodic checkpoint. :func:`start_checkpoint_writer`
creates that queue first, on a Manager that ignores the scheduler's signals (helper_signals); megatron then uses
it for every save.

That queue is a private variable of megatron-core's ``filesystem_async`` module, whose getter 0.17 renamed:
parallel/mcore_compat.py sets it for every supported release; tests/models/test_checkpoint_writer.py fails if that
contract changes.
"""

from __future__ import annotations

import multiprocessing as mp
from multiprocessing.managers import SyncManager

from mcpo_megatron.helper_signals import ignore_scheduler_signals
from mcpo_megatron.parallel import mcore_compat

_manager: SyncManager | None = None


def start_checkpoint_writer() -> None:
    """Make megatron's checkpoint writer's Manager one that ignores the scheduler's signals (idempotent; call
    before the first ``dist_checkpointing.save`` of the process)."""
    global _manager
    if mcore_compat.has_checkpoint_results_queue():
        return
    manager = SyncManager(ctx=mp.get_context("spawn"))  # the context megatron uses for it
    manager.start(initializer=ignore_scheduler_signals)
    mcore_compat.set_checkpoint_results_queue(manager.Queue())
    _manager = manager

