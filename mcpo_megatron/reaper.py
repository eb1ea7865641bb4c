"""A rank that dies leaves no process of its own behind.

A rank starts helper processes: the reward workers, and megatron-core's checkpoint writer starts a
``multiprocessing`` Manager server. When the rank is killed (SIGKILL, out of memory, a node's watchdog) these
are re-parented to init and live on: torchrun signals only the process groups of workers that are still
running, and a Manager server never notices its owner is gone.

So every training rank starts a *reaper*: a small separate process (its own session, so a signal to the rank's
process group does not reach it) that watches the rank. While the rank lives it notes the rank's descendants
every ``interval`` seconds; once the rank is gone it kills them (those it noted, checked by start time so a
reused pid is never hit) and, when the rank led its own process group, the members of that group that were
orphaned (re-parented to init), which also catches a helper started after the last look. It never signals the
whole group: under srun every task of a node joins task 0's process group, so the other ranks live there and
must finish undisturbed (rank 0 often exits first). Then it exits.

    python -m mcpo_megatron.reaper --pid PID      # started by start_reaper(), not by hand
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from mcpo_megatron.helper_signals import ignore_scheduler_signals

DEFAULT_INTERVAL_S = 0.2


def start_reaper(interval_s: float = DEFAULT_INTERVAL_S) -> subprocess.Popen:
    """Start the reaper of this process; it exits after this process does (see the module docstring)."""
    leads_group = os.getpgid(0) == os.getpid()  # known here: the rank may be gone before the reaper looks
    return subprocess.Popen([sys.executable, "-m", "mcpo_megatron.reaper", "--pid", str(os.getpid()),
                             "--interval", str(interval_s), *(["--leads-group"] if leads_group else [])],
                            stdin=subprocess.DEVNULL, start_new_session=True, close_fds=True)


def descendants(pid: int, me: int) -> dict[int, float]:
    """pid -> start time of every live descendant of ``pid`` except ``me``."""
    import psutil

    out = {}
    try:
        for child in psutil.Process(pid).children(recursive=True):
            if child.pid != me:
                try:
                    out[child.pid] = child.create_time()
                except psutil.Error:
                    pass
    except psutil.Error:
        pass
    return out


def kill_noted(noted: dict[int, float]) -> None:
    """SIGKILL each noted process that still has the start time it was noted with (a reused pid is never hit)."""
    import psutil

    for pid, started in noted.items():
        try:
            proc = psutil.Process(pid)
            if proc.create_time() == started:
                proc.kill()
        except psutil.Error:
            pass


def reap_after(pid: int, leads_group: bool, interval_s: float = DEFAULT_INTERVAL_S) -> None:
    """Watch ``pid`` (this process's parent) until it is gone, then kill what it left behind."""
    me = os.getpid()
    noted: dict[int, float] = {}
    while os.getppid() == pid:  # re-parented: the rank is gone (even before its parent reaps it)
        noted.update(descendants(pid, me))
        time.sleep(interval_s)
    if leads_group:
        _kill_orphans_in_group(pid, me)
    kill_noted(noted)


def _running(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _kill_orphans_in_group(pgid: int, me: int) -> None:
    """Kill the processes of group ``pgid`` whose parent is init: the dead rank's helpers that were never noted.
    A process of the group with a living parent (another srun task) is left alone."""
    import psutil

    for proc in psutil.process_iter(["ppid"]):
        try:
            if proc.pid != me and proc.info["ppid"] == 1 and os.getpgid(proc.pid) == pgid:
                proc.kill()
        except (ProcessLookupError, PermissionError, psutil.Error):
            pass


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mcpo_megatron.reaper", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pid", type=int, required=True, help="the rank to watch (must be this process's parent)")
    p.add_argument("--interval", type=float, default=DEFAULT_INTERVAL_S, help="seconds between looks")
    p.add_argument("--leads-group", action="store_true", help="the rank leads its process group")
    args = p.parse_args(argv)
    # A rank that died before this process got here (possibly still a zombie) is cleaned up after all.
    if os.getppid() != args.pid and _running(args.pid):
        print(f"reaper: --pid {args.pid} is not this process's parent ({os.getppid()}); start it with "
              "start_reaper()", file=sys.stderr)
        return 2
    # A Ctrl-C, a preemption signal or a scheduler's TERM is meant for the run, not for its cleanup; the reaper
    # ends on its own right after the rank does.
    ignore_scheduler_signals()
    reap_after(args.pid, args.leads_group, args.interval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
