"""A tool call's supervisor: the zygote's fork that confines the call, starts the process that runs the code,
watches how many processes the code runs, and reports how it all ended.

It leads a session of its own, dies with the zygote, and adopts every orphan of the call (a child subreaper),
so no process of the call leaves its tree. It enters the call's namespaces (isolation.py) as the plan says, then
forks the runner: the first process of the new PID namespace, where there is one. While the runner lives it
counts the call's processes (a watchdog: RLIMIT_NPROC is not enforced for root and counts all of a user's
processes otherwise) and kills the call past ``max_processes``: in a PID namespace the count is one listing of
the call's private /proc, every 5 ms; without one, a walk of the process tree every 50 ms. Once the runner has
ended, the rest of the call is killed (the kernel does it when the namespace's first process ends).

Its report, one JSON object on fd 3 before it exits: the runner's wait status and outcome (runner.OUTCOMES),
``stopped`` (``"processes"`` when the watchdog stopped the call), ``setup_error`` and the isolation ``layers``
that are in place.
"""

from __future__ import annotations

import fcntl
import json
import os
import select
import signal
import time
import traceback

from mcpo_megatron.reaper import descendants, kill_noted
from mcpo_megatron.tools import isolation, runner

REPORT_FD = 3
#: The isolation layers a report names, each True when it is in place for the call.
LAYERS = ("namespaces", "user_namespace", "filesystem", "private_proc")
_OUTCOME_OF = {v: k for k, v in runner.OUTCOMES.items()}
_ABOVE_TARGETS = 64  # arrange_fds copies descriptors here first, so that no copy lands on a target


class SetupError(RuntimeError):
    """A layer the plan requires could not be put in place."""


def arrange_fds(mapping: dict[int, int]) -> None:
    """Make each fd ``target`` a copy of fd ``source`` (``{target: source}``) and close every other descriptor."""
    copies = {target: fcntl.fcntl(source, fcntl.F_DUPFD, _ABOVE_TARGETS) for target, source in mapping.items()}
    for target, copy in copies.items():
        os.dup2(copy, target)
    os.closerange(max(mapping) + 1, _ABOVE_TARGETS)
    os.closerange(_ABOVE_TARGETS, os.sysconf("SC_OPEN_MAX"))
    for fd in range(max(mapping)):
        if fd not in mapping:
            try:
                os.close(fd)
            except OSError:
                pass


def kill_tree(root: int, root_started: float | None = None) -> bool:
    """SIGKILL every process under ``root``, and ``root`` itself when ``root_started`` is its start time: first
    each process group one of them leads, at once (a fork bomb cannot outgrow a group kill), then each process
    (one that left its group). Processes are checked by start time, so a reused pid is never hit. False when
    there was nothing to kill."""
    import psutil

    noted = descendants(root, os.getpid())
    if root_started is not None:
        noted[root] = root_started
    for pid, started in noted.items():
        try:
            if os.getpgid(pid) == pid and psutil.Process(pid).create_time() == started:
                os.killpg(pid, signal.SIGKILL)
        except (OSError, psutil.Error):
            pass
    kill_noted(noted)
    return bool(noted)


class _Children:
    """This process's children, reaped as they end; the runner's wait status once it has ended."""

    def __init__(self, runner_pid: int):
        self.runner_pid = runner_pid
        self.runner_status: int | None = None

    def reap(self, block: bool = False) -> bool:
        """Reap the children that have ended (all of them with ``block``); False once there is none left."""
        while True:
            try:
                pid, status = os.waitpid(-1, 0 if block else os.WNOHANG)
            except ChildProcessError:
                return False
            if pid == 0:
                return True
            if pid == self.runner_pid:
                self.runner_status = status

    def kill_all(self) -> None:
        """Kill every descendant until none is left. Orphans are adopted here, so a process without children has
        no descendant either: the usual end of a call costs no look at the process table."""
        for _ in range(1000):
            if not self.reap() or not kill_tree(os.getpid()):
                break
            time.sleep(0.01)  # the killed need the CPU to end (a fork bomb's run niced): no busy loop of scans
        self.reap(block=True)


def _count_in_private_proc() -> int:
    return sum(1 for name in os.listdir("/proc") if name.isdigit())


def _count_descendants() -> int:
    return len(descendants(os.getpid(), os.getpid()))


def _read_available(fd: int) -> tuple[bytes, bool]:
    """(bytes ready on ``fd``, whether it reached end of file), without blocking."""
    data = b""
    while True:
        try:
            chunk = os.read(fd, 4096)
        except BlockingIOError:
            return data, False
        if not chunk:
            return data, True
        data += chunk


def _watch(children: _Children, sync_fd: int, max_processes: int, pid_namespace: bool, report: dict) -> None:
    """Until the runner ends: read its sync bytes, count the call's processes, stop the call past the limit."""
    try:
        exited = os.pidfd_open(children.runner_pid)
    except (AttributeError, OSError):  # Linux < 5.3: look at the runner every tick
        exited = None
    watched = [fd for fd in (sync_fd, exited) if fd is not None]
    count = None
    next_count = 0.0
    while children.runner_status is None:
        tick = 0.005 if count is _count_in_private_proc else 0.05
        ready = select.select(watched, [], [], tick)[0]
        if sync_fd in ready:
            data, eof = _read_available(sync_fd)
            for char in data:
                if count is None and char in b"PH":
                    report["layers"]["private_proc"] = char == ord("P")
                    count = _count_in_private_proc if char == ord("P") else _count_descendants
                    next_count = time.monotonic() + (0.005 if char == ord("P") else 0.05)
                elif bytes([char]) in _OUTCOME_OF:
                    report["outcome"] = _OUTCOME_OF[bytes([char])]
            if eof:
                watched.remove(sync_fd)
        children.reap()
        if children.runner_status is None and count is not None and time.monotonic() >= next_count:
            next_count = time.monotonic() + tick
            if count() <= max_processes:
                continue
            report["stopped"] = "processes"
            os.killpg(children.runner_pid, signal.SIGKILL)  # in a PID namespace the kernel kills the rest with it
            children.kill_all()
    if exited is not None:
        os.close(exited)
    for char in _read_available(sync_fd)[0]:
        if bytes([char]) in _OUTCOME_OF:
            report["outcome"] = _OUTCOME_OF[bytes([char])]


def supervise(code: str, workdir: str, settings: dict, plan: dict, strict: bool, out_fd: int, report_fd: int,
              zygote_pid: int) -> None:
    """Run one call as the module docstring says; never returns. ``plan``: the layers to put in place
    (``namespaces``, ``user_namespace``, ``filesystem``); ``strict``: a layer that fails is a setup error (a call),
    else it is left out and noted (the zygote's probe)."""
    report = {"status": None, "outcome": None, "stopped": None, "setup_error": None,
              "layers": dict.fromkeys(LAYERS, False), "notes": {}}
    report_to = report_fd  # REPORT_FD once the descriptors are arranged
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        devnull = os.open(os.devnull, os.O_RDWR)
        arrange_fds({0: devnull, 1: out_fd, 2: out_fd, REPORT_FD: report_fd})
        report_to = REPORT_FD
        os.setsid()
        isolation.die_with_parent()
        if os.getppid() != zygote_pid:
            os._exit(runner.SETUP_FAILED_EXIT)
        isolation.become_subreaper()
        layers, notes = report["layers"], report["notes"]

        def attempt(layer: str, step) -> None:
            try:
                step()
                layers[layer] = True
            except OSError as e:
                if strict:
                    raise SetupError(f"{layer}: {e}") from e
                notes[layer] = str(e)

        if plan["namespaces"]:
            attempt("namespaces", lambda: isolation.enter_namespaces(plan["user_namespace"]))
            layers["user_namespace"] = layers["namespaces"] and plan["user_namespace"]
        if layers["namespaces"] and plan["filesystem"]:
            attempt("filesystem", lambda: isolation.confine_filesystem(workdir, settings["limits"]["disk_mb"]))
        sync_r, sync_w = os.pipe()
        life_r, life_w = os.pipe()
        runner_pid = os.fork()
        if runner_pid == 0:
            try:
                arrange_fds({0: 0, 1: 1, 2: 2, runner.SYNC_FD: sync_w, runner.LIFELINE_FD: life_r})
                runner.run(code, workdir, settings["limits"], pid_namespace=layers["namespaces"])
            finally:
                os._exit(runner.SETUP_FAILED_EXIT)
        os.close(sync_w)
        os.close(life_r)
        os.set_blocking(sync_r, False)
        children = _Children(runner_pid)
        _watch(children, sync_r, settings["max_processes"], layers["namespaces"], report)
        report["status"] = children.runner_status
        children.kill_all()  # what the code left running (in a PID namespace the kernel has killed it)
    except SetupError as e:
        report["setup_error"] = str(e)
    except BaseException:  # noqa: BLE001  reported to the parent, which returns the call as "unavailable"
        report["setup_error"] = traceback.format_exc()
    try:
        os.write(report_to, json.dumps(report).encode())
    finally:
        os._exit(0)
