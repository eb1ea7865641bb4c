"""The scheduler's signals are for the rank, never for the helper processes it starts.

SLURM delivers the time-limit SIGTERM, and a signal sent with ``scancel --signal=... --full`` or forwarded by
srun, to every process of the job step: the rank and every process it started. torchrun and a shell's Ctrl-C
reach whole process groups. A helper that dies of such a signal breaks the very checkpoint the rank is about to
write on it (megatron-core's checkpoint writer keeps a ``multiprocessing`` Manager server from its first save on)
or the step it is finishing (reward workers). So every helper a rank starts ignores them, and the rank alone
decides: it stops its helpers with a message, or SIGKILL, when it is done (the reaper cleans up after a rank
that died).

Helpers: the reward workers (rewards/worker.py), the checkpoint writer's Manager (models/checkpoint_writer.py)
and the reaper (reaper.py). The rollout engines run inside the rank (vLLM's external launcher, the PyTorch
engine), so the rank's own handlers (trainer/preemption.py) cover them.
"""

from __future__ import annotations

import signal

SCHEDULER_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def ignore_scheduler_signals() -> None:
    """In a helper process: ignore every signal a scheduler or a terminal sends to a job's processes."""
    for sig in SCHEDULER_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
