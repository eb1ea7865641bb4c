"""The local sandbox: tool calls in killable processes on this node, a bounded pool that never blocks past a
call's deadline.

A zygote process (zygote.py: numpy, sympy, ... imported once) forks one confined process tree per call
(supervisor.py, runner.py). This process keeps the deadlines: a dispatcher thread starts up to ``workers`` calls,
reads each call's output from its own pipe (at most ``max_output_bytes``: past it the call is stopped), and
kills a call's whole process tree when it overruns ``timeout_s``. A zygote that dies is restarted; its calls
return ``unavailable``. Every failure of a call is its result (the text the model reads), never an exception.

Limits of a call: ``timeout_s`` of wall-clock time from its start, ``cpu_s`` of CPU time per process
(RLIMIT_CPU), ``memory_mb`` of address space per process (RLIMIT_AS), ``max_processes`` at once (a watchdog),
``disk_mb`` per file (RLIMIT_FSIZE) and, with namespaces, for its whole directory, ``max_output_bytes`` of
output. Isolation: see isolation.py (kernel) and guard.py (audit hook); :attr:`LocalSandbox.isolation` says which
layers this machine gives.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import queue
import selectors
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from concurrent.futures import Future
from multiprocessing.connection import Connection
from multiprocessing.reduction import sendfds
from pathlib import Path
from typing import Sequence

from mcpo_megatron.config.sections.tools import ISOLATION_MODES
from mcpo_megatron.helper_processes import close_at_exit, refuse_in_bootstrap, unguarded_main_advice
from mcpo_megatron.tools.limits import CallLimits, call_ending, with_note
from mcpo_megatron.tools.supervisor import kill_tree
from mcpo_megatron.tools.sandbox import Sandbox
from mcpo_megatron.tools.types import SandboxError, ToolResult

KILL_GRACE_S = 2.0  # after a kill, how long a call may take to be reported ended before it is given up
DRAIN_S = 1.0  # after a call ended, how long its output pipe may stay open (a process of it still writing)
_MAX_RESTARTS = 3  # zygote restarts in a row that fail before every call is returned unavailable
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
_ZYGOTE_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1",
               "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


class _Zygote:
    """The parent's handle on a zygote process."""

    def __init__(self, settings: dict, startup_timeout_s: float):
        parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        # this process's sys.path (PYTHONPATH included), before the first import; -I: no PYTHON* variable and no
        # user site is read, the environment itself is scrubbed
        paths = [_PACKAGE_ROOT] + [p for p in sys.path if p and p != _PACKAGE_ROOT]
        boot = (f"import sys; sys.path[:0] = {paths!r}; "
                f"from mcpo_megatron.tools.zygote import main; main({child_sock.fileno()})")
        self.proc = subprocess.Popen([sys.executable, "-I", "-B", "-c", boot],
                                     env=dict(_ZYGOTE_ENV, HOME=settings["base"]), cwd=settings["base"],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     pass_fds=(child_sock.fileno(),), close_fds=True)
        child_sock.close()
        self.sock = parent_sock
        self.conn = Connection(os.dup(parent_sock.fileno()))
        try:
            self.conn.send_bytes(json.dumps(settings).encode())
            if not self.conn.poll(startup_timeout_s):
                raise SandboxError(f"the sandbox's zygote was not ready after {startup_timeout_s:g} s")
            msg = json.loads(self.conn.recv_bytes())
        except (EOFError, OSError) as e:
            self.kill()
            raise SandboxError(f"the sandbox's zygote exited during startup (exit code {self.proc.returncode}); "
                               f"its error is above on stderr") from e
        except BaseException:
            self.kill()
            raise
        if msg["op"] == "fatal":
            self.kill()
            raise SandboxError(f"the sandbox cannot start: {msg['error']}")
        self.pid = msg["pid"]
        self.layers, self.notes = msg["layers"], msg["notes"]
        self.address_space_mb = msg["address_space_mb"]

    def send_run(self, call_id: int, code: str, out_fd: int) -> None:
        self.conn.send_bytes(json.dumps({"op": "run", "id": call_id, "code": code}).encode())
        sendfds(self.sock, [out_fd])

    def kill(self) -> None:
        """SIGKILL the zygote and every call of it."""
        kill_tree(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        self.close()

    def stop(self) -> None:
        """Ask the zygote to end its calls and exit; kill it if it has not within a few seconds."""
        try:
            self.conn.send_bytes(json.dumps({"op": "stop"}).encode())
            self.proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            pass
        self.kill()

    def close(self) -> None:
        self.conn.close()
        self.sock.close()


class _Call:
    def __init__(self, call_id: int, code: str, future: Future):
        self.id, self.code, self.future = call_id, code, future
        self.fd: int | None = None
        self.sent_at = self.deadline = self.ended_at = self.killed_at = math.inf
        self.pid: int | None = None
        self.start: float | None = None
        self.out = bytearray()
        self.truncated = False
        self.eof = False
        self.exit: dict | None = None  # the zygote's exit message
        self.stop_reason: str | None = None  # why this process stopped it: timeout | output | lost


class LocalSandbox(Sandbox):
    """Run Python code blocks in confined, killable processes on this node (module docstring).

    Args:
        workers: calls that run at once.
        limits: what each call may use (:class:`~mcpo_megatron.tools.limits.CallLimits`).
        preload: modules the zygote imports once for every call.
        isolation: ``auto`` | ``namespaces`` (refuse to start without them) | ``plain`` (ISOLATION_MODES).
        startup_timeout_s: time the zygote may take to import ``preload`` and probe the isolation.
    """

    def __init__(self, workers: int = 2, limits: CallLimits = CallLimits(), *,
                 preload: Sequence[str] = ("numpy", "sympy"), isolation: str = "auto",
                 startup_timeout_s: float = 120.0):
        refuse_in_bootstrap("a sandbox cannot start in this process: " + unguarded_main_advice(
            "this process was started", "a LocalSandbox (or trains)", "runs tools or trains"))
        if not (isinstance(workers, int) and not isinstance(workers, bool) and workers >= 1):
            raise ValueError(f"LocalSandbox: workers={workers!r} is invalid: must be an int >= 1.")
        if isolation not in ISOLATION_MODES:
            raise ValueError(f"LocalSandbox: isolation={isolation!r} is invalid: must be one of {ISOLATION_MODES}.")
        self.workers, self.limits = workers, limits
        self.timeout_s = limits.timeout_s  # the Sandbox interface's batch deadline
        self.startup_timeout_s = float(startup_timeout_s)
        self._base = tempfile.mkdtemp(prefix="mcpo-sandbox-")
        self._settings = {"base": self._base, "preload": list(preload),
                          "limits": {"cpu_s": limits.cpu_s, "memory_mb": limits.memory_mb, "disk_mb": limits.disk_mb},
                          "max_processes": limits.max_processes, "isolation": isolation}
        try:
            self._zygote: _Zygote | None = _Zygote(self._settings, self.startup_timeout_s)
        except BaseException:
            shutil.rmtree(self._base, ignore_errors=True)
            raise
        #: The isolation layers in place for every call (True / False each) and why those missing are.
        self.isolation = {"layers": self._zygote.layers, "notes": self._zygote.notes}
        if not self._zygote.layers["namespaces"]:
            why = "isolation='plain'" if isolation == "plain" else \
                self._zygote.notes.get("namespaces", self._zygote.notes.get("probe", "unknown"))
            warnings.warn(f"tool sandbox: calls run without the kernel's namespaces ({why}): they are confined by "
                          "rlimits, a process watchdog and an audit hook only (the network, writes outside the "
                          "call's directory and other processes are refused by the hook, not by the kernel)",
                          stacklevel=2)
        self._queue: "queue.SimpleQueue[_Call | None]" = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._next_id = 0
        self._id_lock = threading.Lock()
        self._closed = False
        self._broken: str | None = None
        self._given_up: set[int] = set()  # calls finished before the zygote said it started them
        self._thread = threading.Thread(target=self._dispatch, name="mcpo-tool-sandbox", daemon=True)
        self._thread.start()
        self._close_at_exit = close_at_exit(self)

    # ------------------------------------------------------------------ interface
    def submit(self, code: str) -> "Future[ToolResult]":
        if not isinstance(code, str):
            raise TypeError(f"LocalSandbox.submit: code must be str, got {type(code).__name__}")
        if self._closed:
            raise RuntimeError("LocalSandbox.submit called after close(); create a new sandbox")
        with self._id_lock:
            call = _Call(self._next_id, code, Future())
            self._next_id += 1
        if not self._thread.is_alive():
            call.future.set_result(ToolResult(f"The sandbox could not run the code: {self._broken}", "unavailable",
                                              0.0))
            return call.future
        self._queue.put(call)
        self._wake()
        return call.future

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except OSError:  # full (and so waking the dispatcher already), or closed
            pass

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._close_at_exit)
        self._queue.put(None)
        self._wake()
        self._thread.join(timeout=self.timeout_s + 30)
        if self._zygote is not None:
            self._zygote.stop()
            self._zygote = None
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)
        shutil.rmtree(self._base, ignore_errors=True)

    def __del__(self):  # best effort; the zygote also ends when this process does
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass

    # ------------------------------------------------------------------ dispatcher thread
    def _dispatch(self) -> None:
        waiting: list[_Call] = []
        active: dict[int, _Call] = {}
        try:
            self._serve(waiting, active)
        except BaseException:  # noqa: BLE001  a defect here must not leave a caller waiting
            self._broken = "its dispatcher failed:\n" + traceback.format_exc()
            for call in [*waiting, *active.values()]:
                if not call.future.done() and (call.future.running() or call.future.set_running_or_notify_cancel()):
                    call.future.set_result(ToolResult(f"The sandbox could not run the code: {self._broken}",
                                                      "unavailable", 0.0))
            raise

    def _serve(self, waiting: list[_Call], active: dict) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._watch_zygote(selector)
        stopping = False
        while True:
            stopping |= self._take_submissions(waiting)
            if stopping:
                for call in [*waiting, *active.values()]:
                    self._stop(call, "lost")
                    self._finish(call, selector, active)
                return
            while waiting and len(active) < self.workers:
                call = waiting.pop(0)
                if call.future.set_running_or_notify_cancel():
                    self._begin(call, selector, active)
            now = time.monotonic()
            wake = min([c.deadline for c in active.values()] + [c.killed_at + KILL_GRACE_S for c in active.values()]
                       + [c.ended_at + DRAIN_S for c in active.values()] + [now + 1.0])
            for key, _ in selector.select(max(0.0, wake - now)):
                if key.data == "wake":
                    try:
                        while os.read(self._wake_r, 4096):
                            pass
                    except BlockingIOError:
                        pass
                elif key.data == "zygote":
                    if self._zygote is not None:
                        self._zygote_messages(selector, active)
                elif key.data in active:  # not a call the zygote's death just ended
                    self._read_output(active[key.data])
            now = time.monotonic()
            for call in list(active.values()):
                if call.exit is None and call.stop_reason is None and now >= call.deadline:
                    self._stop(call, "timeout")
                if (call.exit is not None and (call.eof or now >= call.ended_at + DRAIN_S)) or \
                        now >= call.killed_at + KILL_GRACE_S:
                    self._finish(call, selector, active)

    def _take_submissions(self, waiting: list[_Call]) -> bool:
        """Move submitted calls to ``waiting``; True once close() asked the dispatcher to stop."""
        while True:
            try:
                call = self._queue.get_nowait()
            except queue.Empty:
                return False
            if call is None:
                return True
            waiting.append(call)

    def _watch_zygote(self, selector) -> None:
        if self._zygote is not None:
            selector.register(self._zygote.conn.fileno(), selectors.EVENT_READ, "zygote")

    def _begin(self, call: _Call, selector, active: dict) -> None:
        if self._zygote is None and not self._restart(selector):
            call.future.set_result(ToolResult(f"The sandbox could not run the code: {self._broken}",
                                              "unavailable", 0.0))
            return
        read_fd, write_fd = os.pipe()
        os.set_blocking(read_fd, False)
        call.fd = read_fd
        call.sent_at = time.monotonic()
        call.deadline = call.sent_at + self.timeout_s
        active[call.id] = call
        selector.register(read_fd, selectors.EVENT_READ, call.id)
        try:
            self._zygote.send_run(call.id, call.code, write_fd)
        except OSError:
            self._zygote_lost(selector, active)
        finally:
            os.close(write_fd)

    def _read_output(self, call: _Call) -> None:
        try:
            data = os.read(call.fd, 65536)
        except BlockingIOError:
            return
        if not data:
            call.eof = True
            return
        room = self.limits.max_output_bytes - len(call.out)
        if room > 0:
            call.out += data[:room]
        if len(data) > room:
            call.truncated = True
            self._stop(call, "output")

    def _zygote_messages(self, selector, active: dict) -> None:
        try:
            while self._zygote.conn.poll():
                msg = json.loads(self._zygote.conn.recv_bytes())
                call = active.get(msg["id"])
                if call is None:
                    if msg["op"] == "started" and msg["id"] in self._given_up:
                        kill_tree(msg["pid"], msg["start"])  # the zygote was late: the call is over for us
                    continue
                if msg["op"] == "started":
                    call.pid, call.start = msg["pid"], msg["start"]
                    if call.stop_reason is not None:
                        self._kill_tree(call)
                elif msg["op"] == "exited":
                    call.exit = msg
                    call.ended_at = time.monotonic()
        except (EOFError, OSError):
            self._zygote_lost(selector, active)

    def _zygote_lost(self, selector, active: dict) -> None:
        """The zygote died: its calls return unavailable; the next call starts a new one."""
        selector.unregister(self._zygote.conn.fileno())
        self._zygote.kill()
        self._zygote = None
        for call in list(active.values()):
            self._stop(call, "lost")
            self._finish(call, selector, active)

    def _restart(self, selector) -> bool:
        """A new zygote; False (and every later call unavailable) when _MAX_RESTARTS in a row fail."""
        if self._broken is not None:
            return False
        for _ in range(_MAX_RESTARTS):
            try:
                self._zygote = _Zygote(self._settings, self.startup_timeout_s)
                self._watch_zygote(selector)
                return True
            except SandboxError as e:
                error = str(e)
        self._broken = error
        return False

    def _stop(self, call: _Call, reason: str) -> None:
        if call.stop_reason is None:
            call.stop_reason = reason
            call.killed_at = time.monotonic()
        self._kill_tree(call)

    def _kill_tree(self, call: _Call) -> None:
        """SIGKILL the call's supervisor and every process under it (checked by start time: a reused pid is never
        hit); before the zygote said which process it is, the kill waits for that message."""
        if call.pid is not None and call.start is not None:
            kill_tree(call.pid, call.start)

    def _finish(self, call: _Call, selector, active: dict) -> None:
        active.pop(call.id, None)
        if call.exit is None and call.pid is None and call.sent_at != math.inf:
            self._given_up.add(call.id)
        if call.fd is not None:
            selector.unregister(call.fd)
            if not call.eof:
                try:
                    self._read_output(call)
                except OSError:
                    pass
            os.close(call.fd)
            call.fd = None
        if not call.future.done():
            seconds = time.monotonic() - call.sent_at if call.sent_at != math.inf else 0.0
            status, note = call_ending(call.stop_reason, call.exit, self.limits)
            call.future.set_result(ToolResult(text=with_note(call.out, note), status=status,
                                              seconds=round(seconds, 4), truncated=call.truncated))
