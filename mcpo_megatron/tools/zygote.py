"""The sandbox's zygote: a process that imports what calls use (numpy, sympy, ...) once, then forks one
supervisor per call (supervisor.py), so that every call starts warm and from the same clean state, and none sees
what another left.

Started by :class:`~mcpo_megatron.tools.local.LocalSandbox` with a scrubbed environment and one Unix socket.
Protocol, JSON objects framed by multiprocessing's Connection:

  parent -> zygote: the settings (first message), then ``{"op": "run", "id", "code"}`` followed by the write end
  of the call's output pipe (SCM_RIGHTS), or ``{"op": "stop"}``;
  zygote -> parent: ``{"op": "ready", "pid", "layers", "notes", "address_space_mb"}`` or ``{"op": "fatal",
  "error"}``,
  then per call ``{"op": "started", "id", "pid", "start"}`` and ``{"op": "exited", "id", "status", "cpu_s",
  "report"}`` (the supervisor's report, None when it was killed).

It never runs a call's code itself. It probes once which isolation layers this machine allows (a call of empty
code with each plan, most confined first) and runs every call with the layers that worked. It adopts the
orphans of killed calls and kills them, removes each call's directory, and ends its calls and itself when the
parent is gone (the socket closes, or it is re-parented).
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import selectors
import shutil
import signal
import socket
import time
import traceback
from multiprocessing.connection import Connection
from multiprocessing.reduction import recvfds

from mcpo_megatron.helper_signals import ignore_scheduler_signals
from mcpo_megatron.tools import isolation, runner, supervisor

PARENT_CHECK_S = 1.0  # how often the zygote checks that the process that started it is alive
PROBE_ID = -1
# Modules a call's supervisor and runner use, imported here so that no call pays for them.
_OWN_IMPORTS = ("psutil", "traceback", "linecache", "tempfile", "json", "fractions", "decimal", "itertools",
                "functools", "collections", "math", "cmath", "random", "statistics", "re", "string", "heapq",
                "bisect", "datetime")

# The first use of these libraries imports their lazy parts and fills their caches (sympy's first factor() costs
# a call about 35 ms of CPU): done once here, for every call.
_WARM_UPS = {
    "numpy": "import numpy as np\nnp.linalg.solve(np.eye(2), np.ones(2)); np.fft.fft(np.ones(4))\n"
             "np.random.default_rng(0).random(2); np.array([1.5]).round(1); str(np.arange(3))",
    "sympy": "import sympy as sp\nx = sp.Symbol('x')\nsp.factor(x**2 - 1); sp.solve(x**2 - 2, x)\n"
             "sp.expand((x + 1)**3)\n"
             "sp.simplify(sp.sin(x)**2 + sp.cos(x)**2); sp.integrate(x**2, x); sp.N(sp.pi, 20); sp.isprime(97)\n"
             "sp.Rational(1, 3) + sp.Rational(1, 6); sp.Matrix([[1, 2], [3, 4]]).det(); sp.latex(x / 2)",
}


def _start_time(pid: int) -> float | None:
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def _address_space_mb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) // 1024
    return 0


def _remove(path: str) -> None:
    """Remove a call's directory, whatever the code made of it: directories it left without permissions are
    opened up first (never through a symbolic link, which may point anywhere)."""
    for root, dirs, _ in os.walk(path):  # top-down: a directory is opened up before it is walked into
        for name in dirs:
            child = os.path.join(root, name)
            try:
                if not os.path.islink(child):
                    os.chmod(child, 0o700)
            except OSError:
                pass
    shutil.rmtree(path, ignore_errors=True)


def _drain(fd: int) -> bytes:
    """What is ready on ``fd``, without blocking."""
    data = b""
    os.set_blocking(fd, False)
    try:
        while chunk := os.read(fd, 65536):
            data += chunk
    except BlockingIOError:
        pass
    return data


def _report(fd: int) -> dict | None:
    """A supervisor's report from its (closed) report pipe, which is then closed; None when it wrote none."""
    data = _drain(fd)
    os.close(fd)
    try:
        return json.loads(data) if data else None
    except ValueError:
        return None


class _CannotStart(Exception):
    """A startup check failed: its message is the whole error."""


def _preload(names) -> None:
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001  ImportError, or whatever the module raises on import
            raise _CannotStart(f"preload: the module {name!r} cannot be imported in the sandbox "
                               f"({type(e).__name__}: {e})") from e



class Zygote:
    def __init__(self, conn: Connection, sock: socket.socket, settings: dict):
        self.conn, self.sock, self.settings = conn, sock, settings
        self.pid = os.getpid()
        self.plan = {"namespaces": False, "user_namespace": False, "filesystem": False}
        self.calls: dict[int, tuple[int, str, int]] = {}  # supervisor pid -> (call id, directory, report fd)
        self.exits: list[dict] = []  # exit messages not sent yet

    # ------------------------------------------------------------------ calls
    def start(self, call_id: int, code: str, out_fd: int, strict: bool) -> int:
        workdir = os.path.join(self.settings["base"], f"call-{call_id}" if call_id >= 0 else "probe")
        os.mkdir(workdir, 0o700)
        report_r, report_w = os.pipe()
        try:
            pid = os.fork()
        except OSError:
            for fd in (report_r, report_w):
                os.close(fd)
            os.rmdir(workdir)
            raise
        if pid == 0:
            try:
                supervisor.supervise(code, workdir, self.settings, self.plan, strict, out_fd, report_w, self.pid)
            finally:
                os._exit(runner.SETUP_FAILED_EXIT)
        os.close(out_fd)
        os.close(report_w)
        self.calls[pid] = (call_id, workdir, report_r)
        return pid

    def reap(self, sweep: bool = True) -> None:
        """Reap every child that has ended: a supervisor's exit message is queued and its directory removed (after
        its orphans, when it may have left any, are killed); an orphan is just reaped."""
        orphans_possible = False
        while True:
            try:
                pid, status, rusage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if pid not in self.calls:
                continue
            call_id, workdir, report_r = self.calls.pop(pid)
            report = _report(report_r)
            # A supervisor kills its call's processes before it reports; one that was killed itself may have left
            # some (re-parented here), unless the kernel killed them with the first process of their PID namespace.
            orphans_possible |= report is None and not self.plan["namespaces"]
            self.exits.append({"op": "exited", "id": call_id, "status": status,
                               "cpu_s": rusage.ru_utime + rusage.ru_stime, "report": report, "dir": workdir})
        if sweep and orphans_possible:
            self.kill_orphans()
        for message in self.exits:
            if "dir" in message:
                _remove(message.pop("dir"))

    def kill_orphans(self) -> None:
        """Kill the processes re-parented here that are no call's supervisor, and all they started."""
        import psutil

        for _ in range(100):
            try:
                orphans = [child for child in psutil.Process(self.pid).children() if child.pid not in self.calls]
            except psutil.Error:
                return
            if not orphans:
                return
            for child in orphans:
                try:
                    supervisor.kill_tree(child.pid, child.create_time())
                except psutil.Error:
                    pass
            self.reap(sweep=False)

    def stop_all(self) -> None:
        """Kill every call (all descendants), reap them and remove their directories."""
        for _ in range(100):
            if not supervisor.kill_tree(self.pid):
                break
            self.reap(sweep=False)
        for _, workdir, _ in self.calls.values():
            _remove(workdir)

    # ------------------------------------------------------------------ isolation
    def probe(self) -> dict:
        """Run one call of empty code under the current plan and wait for it: the supervisor's report, plus
        its ``output``."""
        out_r, out_w = os.pipe()
        pid = self.start(PROBE_ID, "", out_w, strict=False)
        while pid in self.calls:
            time.sleep(0.005)
            self.reap()
        message = self.exits.pop()
        output = _drain(out_r)
        os.close(out_r)
        report = message["report"] or {"setup_error": f"the probe's supervisor ended with wait status "
                                                      f"{message['status']}", "layers": {}, "notes": {}}
        return dict(report, output=output.decode(errors="replace"))

    def choose_plan(self, isolation_mode: str) -> tuple[dict, dict]:
        """Probe plans, most confined first: the layers in place and notes on those that are not."""
        plans = []
        if isolation_mode in ("auto", "namespaces"):
            plans.append({"namespaces": True, "user_namespace": True, "filesystem": True})
            if os.geteuid() == 0:  # root may enter the other namespaces without a user namespace
                plans.append({"namespaces": True, "user_namespace": False, "filesystem": True})
        if isolation_mode in ("auto", "plain"):
            plans.append({"namespaces": False, "user_namespace": False, "filesystem": False})
        notes: dict = {}
        for plan in plans:
            self.plan = plan
            report = self.probe()
            for layer, why in (report.get("notes") or {}).items():
                notes.setdefault(layer, why)
            if report.get("setup_error") or report.get("outcome") != "ok":
                notes.setdefault("probe", ((report.get("setup_error") or "") + report["output"]).strip())
                continue
            if plan["namespaces"] and not report["layers"]["namespaces"]:
                continue
            self.plan = dict(plan, filesystem=report["layers"]["filesystem"])
            return report["layers"], notes
        raise _CannotStart(f"isolation={isolation_mode!r}: the sandbox cannot confine a call here: "
                           + "; ".join(f"{layer}: {why}" for layer, why in notes.items()))

    # ------------------------------------------------------------------ serving
    def serve(self) -> None:
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_r, False)
        os.set_blocking(wake_w, False)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.set_wakeup_fd(wake_w)
        selector = selectors.DefaultSelector()
        selector.register(self.conn.fileno(), selectors.EVENT_READ, "parent")
        selector.register(wake_r, selectors.EVENT_READ, "child")
        parent = os.getppid()
        try:
            while os.getppid() == parent:
                for key, _ in selector.select(PARENT_CHECK_S):
                    if key.data == "child":
                        _drain(wake_r)
                    elif not self.handle(json.loads(self.conn.recv_bytes())):
                        return
                self.reap()
                while self.exits:
                    self.conn.send_bytes(json.dumps(self.exits.pop(0)).encode())
        except (EOFError, OSError):
            pass  # the parent is gone
        finally:
            self.stop_all()
        # Here only when the parent is gone (a stop returns above): nobody else will remove the pool's directory.
        shutil.rmtree(self.settings["base"], ignore_errors=True)

    def handle(self, msg: dict) -> bool:
        if msg["op"] == "stop":
            return False
        out_fd = recvfds(self.sock, 1)[0]
        try:
            pid = self.start(msg["id"], msg["code"], out_fd, strict=True)
        except OSError as e:  # no directory or no process for it (a full disk, no memory left)
            os.close(out_fd)
            error = f"the zygote could not start the call: {e}"
            self.exits.append({"op": "exited", "id": msg["id"], "status": None, "cpu_s": 0.0,
                               "report": {"setup_error": error, "stopped": None, "status": None, "outcome": None}})
            return True
        self.conn.send_bytes(json.dumps({"op": "started", "id": msg["id"], "pid": pid,
                                         "start": _start_time(pid)}).encode())
        return True


def main(fd: int) -> None:
    """The zygote's entry point (``python -c``), on the socket inherited as ``fd``."""
    ignore_scheduler_signals()
    sock = socket.socket(fileno=fd)
    conn = Connection(os.dup(fd))
    try:
        settings = json.loads(conn.recv_bytes())
        zygote = Zygote(conn, sock, settings)
        isolation.become_subreaper()
        _preload(_OWN_IMPORTS)
        _preload(settings["preload"])
        for name in settings["preload"]:
            if name in _WARM_UPS:
                exec(_WARM_UPS[name], {})
        gc.collect()
        gc.freeze()  # forked calls do not copy the imported objects' pages by touching their GC headers
        size = _address_space_mb()
        memory_mb = settings["limits"]["memory_mb"]
        if memory_mb and memory_mb < size + 64:
            raise _CannotStart(f"memory_mb={memory_mb} leaves a call no room: the zygote takes {size} MiB of "
                               f"address space with its imports (preload: {', '.join(settings['preload']) or 'none'});"
                               f" give at least {size + 64}, or 0 for no cap")
        layers, notes = zygote.choose_plan(settings["isolation"])
    except _CannotStart as e:
        conn.send_bytes(json.dumps({"op": "fatal", "error": str(e)}).encode())
        return
    except BaseException:  # noqa: BLE001  the parent raises SandboxError with this text
        conn.send_bytes(json.dumps({"op": "fatal", "error": traceback.format_exc()}).encode())
        return
    conn.send_bytes(json.dumps({"op": "ready", "pid": os.getpid(), "layers": layers, "notes": notes,
                                "address_space_mb": size}).encode())
    zygote.serve()
