"""Preemption: the signals that ask a run to checkpoint and exit, and the lead time that takes.

With ``checkpoint.save_on_signal`` (the default) SIGTERM and SIGUSR1 set a flag instead of ending the process
(``slurm/train.sbatch`` forwards SLURM's ``--signal=B:USR1@<lead>`` to every rank). What the trainer does
depends on when the flag is set:

* during generation (the step's rollouts, the retention probe): the policy still holds the weights the step
  started from, so the previous step is checkpointed at once (with the data sampler, mastery tracker and RNG
  states of the step's start: the resumed run repeats the interrupted step exactly). Colocated engines stop at
  their next decoding step; engines on ranks of their own finish the step's batches first and the checkpoint
  holds them (``held_batches.py``);
* later in the step: the step finishes (old log-probs, updates, reshard, eval), is logged and checkpointed (with
  separate placement, once the engines have finished the next step's batch, which the checkpoint holds).

So the time a signal needs before the job's end is at most one step's work after generation plus a checkpoint:
the trainer logs it every step as ``time/preempt_lead_needed`` and warns when it exceeds the lead the job was
given (``MCPO_SIGNAL_LEAD_S``, which the sbatch script exports from ``SBATCH_SIGNAL``). ``mcpo plan`` estimates
it before a job is queued.

With ``checkpoint.save_on_signal=false`` no handler is installed: SIGTERM and SIGUSR1 keep their default
action and end the process.
"""

from __future__ import annotations

import os
import signal

import torch

from mcpo_megatron.parallel.distributed import all_reduce_max

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
LEAD_ENV = "MCPO_SIGNAL_LEAD_S"


class StopRequest:
    """A flag set by SIGTERM / SIGUSR1 when ``enabled``; :meth:`close` restores the previous handlers."""

    def __init__(self, enabled: bool) -> None:
        self.signal_name: str | None = None
        self._previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS} if enabled else {}

    def _handle(self, signum, _frame) -> None:
        self.signal_name = signal.Signals(signum).name

    def requested(self) -> bool:
        """This rank was signalled (a local check: the engines poll it between decoding steps)."""
        return self.signal_name is not None

    def agreed(self) -> bool:
        """Collective: True on every rank if any rank was signalled (a signal may reach only some of them)."""
        if not self._previous:
            return False
        flag = torch.tensor([1 if self.signal_name else 0], dtype=torch.int32)  # a CPU flag (gloo)
        return bool(all_reduce_max(flag).item() > 0)

    def close(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


def signal_lead_s(environ=os.environ) -> float | None:
    """The seconds between the preemption signal and the job's end, when the launcher says (``MCPO_SIGNAL_LEAD_S``)."""
    value = environ.get(LEAD_ENV)
    try:
        return float(value) if value else None
    except ValueError:
        return None


def lead_time_warning(needed_s: float, lead_s: float | None) -> str | None:
    """A warning when a signal at the worst moment of the last step would not leave time to checkpoint."""
    if lead_s is None or needed_s <= lead_s:
        return None
    return (f"warning: a preemption signal right after generation needs {needed_s:.0f} s to finish the step and "
            f"checkpoint, more than the {lead_s:.0f} s this job's signal leaves before its end; submit with "
            f"SBATCH_SIGNAL=B:USR1@{int(needed_s * 1.25) + 60} (see slurm/train.sbatch)")
