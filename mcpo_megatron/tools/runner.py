"""The process that runs a tool call's code: it finishes its own confinement, then runs the code as a script's
``__main__`` and tells its supervisor how the code ended.

It is a fork of the zygote (which imported numpy, sympy and the rest once), so nothing a previous call set (a
variable, a module's state, a file) exists here. Its output goes to the pipe the parent reads, stdout and stderr
unbuffered into one stream in the order written; stdin is /dev/null.

Protocol with the supervisor, on the sync pipe (fd 3): one byte once the setup is done, ``P`` (a private /proc
of its own PID namespace is mounted) or ``H`` (the host's /proc is in view), then one byte of :data:`OUTCOMES`
when the code ends. fd 4 is the supervisor's lifeline: readable (EOF) once the supervisor is gone.
"""

from __future__ import annotations

import builtins
import io
import math
import os
import resource
import select
import signal
import sys
import traceback
import types

from mcpo_megatron.helper_signals import SCHEDULER_SIGNALS
from mcpo_megatron.tools import guard, isolation

CODE_NAME = "<code>"  # the file name the code's traceback shows
SYNC_FD, LIFELINE_FD = 3, 4
SETUP_FAILED_EXIT = 121
# The processes the code forks run at this niceness: below their supervisor, which must outrun a fork bomb to
# count and stop it. The code's own process keeps the priority of the trainer's.
FORKED_NICENESS = 10
#: How the code ended, as the byte the runner sends.
OUTCOMES = {"ok": b"o", "exception": b"e", "refused": b"r", "memory": b"m", "exit": b"x"}
# What the code sees: no variable of the trainer's, its directory as home and temporary directory.
_PATH = "/usr/local/bin:/usr/bin:/bin"


def _stdio() -> None:
    """Unbuffered text streams on fds 0-2 (as ``python -u``), so stdout and stderr interleave as written."""
    out = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8", errors="backslashreplace",
                           write_through=True)
    err = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8", errors="backslashreplace",
                           write_through=True)
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
    sys.stdout = sys.__stdout__ = out
    sys.stderr = sys.__stderr__ = err


def _keep_scheduler_signals_out() -> None:
    """The runner ignores the scheduler's signals, as every helper of a rank does (helper_signals), so a job's TERM
    does not end the calls of the step being finished; it also blocks them, so that one sent to a process the code
    forks before that process has its dispositions back (multiprocessing ends its workers with SIGTERM) waits for
    them instead of being dropped."""
    signal.pthread_sigmask(signal.SIG_BLOCK, SCHEDULER_SIGNALS)


def _in_a_forked_process() -> None:
    """In a process the code forks: FORKED_NICENESS, and Python's own signal dispositions, then the signals."""
    os.setpriority(os.PRIO_PROCESS, 0, max(FORKED_NICENESS, os.getpriority(os.PRIO_PROCESS, 0)))
    for sig in SCHEDULER_SIGNALS:
        signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SCHEDULER_SIGNALS)


def _environment(workdir: str) -> None:
    import tempfile

    os.environ.clear()  # unsets every variable in the process's C environment too
    os.environ.update(PATH=_PATH, HOME=workdir, TMPDIR=workdir, LANG="C.UTF-8", OMP_NUM_THREADS="1",
                      OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    tempfile.tempdir = workdir
    os.chdir(workdir)


def _limits(cpu_s: float, memory_mb: int, disk_mb: int) -> None:
    # RLIMIT_CPU counts whole seconds; soft = hard: SIGKILL at the limit (SIGXCPU at a lower soft limit would not
    # reach the first process of a PID namespace, which ignores every signal it has no handler for).
    cpu = max(1, math.ceil(cpu_s))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    if memory_mb:
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
    resource.setrlimit(resource.RLIMIT_FSIZE, (disk_mb << 20, disk_mb << 20))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _sandbox_frames_dropped(report: traceback.TracebackException) -> None:
    """Drop the frames of the runner (before the code's first) and of the audit hook (after the code's call
    that raised the event), in ``report`` and the exceptions chained to it."""
    todo, seen = [report], set()
    while todo:
        report = todo.pop()
        if report is None or id(report) in seen:
            continue
        seen.add(id(report))
        stack = list(report.stack)
        while stack and stack[0].filename != CODE_NAME:
            stack.pop(0)
        while stack and stack[-1].filename == guard.__file__:
            stack.pop()
        report.stack = traceback.StackSummary.from_list(stack)
        todo += [report.__cause__, report.__context__]


def _print_exception(exc: BaseException) -> None:
    """The traceback as Python prints it, without the sandbox's own frames."""
    try:
        report = traceback.TracebackException(type(exc), exc, exc.__traceback__)
        _sandbox_frames_dropped(report)
        sys.stderr.write("".join(report.format()))
    except MemoryError:
        os.write(2, f"{type(exc).__name__}: {exc}\n".encode(errors="replace"))


def _execute(code: str) -> tuple[str, int]:
    """Run ``code`` as ``__main__``: (outcome, exit status)."""
    import linecache

    linecache.cache[CODE_NAME] = (len(code), None, code.splitlines(True), CODE_NAME)
    main = types.ModuleType("__main__")
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    sys.argv = [""]
    try:
        exec(compile(code, CODE_NAME, "exec"), main.__dict__)
    except SystemExit as e:
        if e.code is None or e.code == 0:
            return "ok", 0
        if isinstance(e.code, int):
            return "exit", e.code & 0xFF
        print(e.code, file=sys.stderr)
        return "exit", 1
    except BaseException as e:  # noqa: BLE001  the code's own error is its result
        _print_exception(e)
        if _caused_by(e, guard.SandboxRefusal):  # also through a library's own error (urllib's URLError)
            return "refused", 1
        return ("memory" if _caused_by(e, MemoryError) else "exception"), 1
    return "ok", 0


def _caused_by(exc: BaseException, kind: type) -> bool:
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, kind):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def run(code: str, workdir: str, limits: dict, pid_namespace: bool) -> None:
    """Confine this process, run ``code``, report its outcome on the sync pipe and exit (never returns).
    ``limits``: cpu_s, memory_mb, disk_mb."""
    try:
        isolation.die_with_parent()
        if select.select([LIFELINE_FD], [], [], 0)[0]:  # the supervisor died before the line above
            os._exit(SETUP_FAILED_EXIT)
        os.setpgid(0, 0)  # a group of its own: kill(0) hits the code's processes, never the supervisor
        private_proc = False
        if pid_namespace:
            try:
                isolation.mount_private_proc()
                private_proc = True
            except OSError:
                pass  # the host's /proc stays in view; the supervisor counts processes there
        _stdio()
        _environment(workdir)
        _keep_scheduler_signals_out()
        os.register_at_fork(after_in_child=_in_a_forked_process)
        isolation.drop_privileges()
        _limits(limits["cpu_s"], limits["memory_mb"], limits["disk_mb"])
        guard.install(workdir, pid_namespace, private_proc)
        os.write(SYNC_FD, b"P" if private_proc else b"H")
    except BaseException:  # noqa: BLE001  the parent reports the call "unavailable" with this text
        traceback.print_exc()
        os._exit(SETUP_FAILED_EXIT)
    outcome, status = _execute(code)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001  e.g. the parent closed the pipe after the output cap
            pass
    try:
        os.write(SYNC_FD, OUTCOMES[outcome])
    except OSError:
        pass
    os._exit(status)
