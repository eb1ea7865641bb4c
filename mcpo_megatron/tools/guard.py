"""The second layer inside a tool call: a Python audit hook (PEP 578) that refuses what the code may not do.

It refuses Python's own ways to reach the network (``socket`` other than a Unix socket pair, name lookups,
``connect``/``bind``/``sendto``), other programs (``subprocess``, ``os.system``, ``os.exec*``, ``os.posix_spawn``),
files outside the call's directory (``open`` for writing, ``os.remove``/``rename``/``mkdir``/``chmod``/...,
``shutil``'s copies and moves), C functions (``ctypes``) and the call's own limits (``resource.setrlimit``);
without a PID namespace also signals to processes outside the call and other processes' ``/proc`` entries. The
refusal is a :class:`SandboxRefusal` (a PermissionError) raised in the code, which may catch it; uncaught, the call
ends with status ``refused``.

It is a guard, not a boundary: code that reaches C another way (an extension module it writes and imports,
memory it corrupts) gets past it. The namespaces are the boundary (isolation.py) where the kernel allows them.
"""

from __future__ import annotations

import os
import socket
import sys
import threading


class SandboxRefusal(PermissionError):
    """An operation the sandbox refuses; raised inside the call's code."""


SandboxRefusal.__module__ = "builtins"  # the model reads "SandboxRefusal: ...", not this module's path

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
_WRITABLE_ANYWHERE = frozenset({"/dev/null", "/dev/zero", "/dev/full", "/dev/stdout", "/dev/stderr",
                                "/proc/self/fd/1", "/proc/self/fd/2"})
_PROGRAMS = frozenset({"subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.forkpty",
                       "os.startfile"})
_NETWORK = frozenset({"socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "socket.getaddrinfo",
                      "socket.gethostbyname", "socket.gethostbyaddr", "socket.getnameinfo", "socket.sethostname"})
_C_FUNCTIONS = frozenset({"ctypes.dlopen", "ctypes.dlsym", "ctypes.dlsym/handle", "ctypes.addressof", "ctypes.cdata",
                          "ctypes.cdata/buffer", "ctypes.string_at", "ctypes.wstring_at", "ctypes.call_function"})
_LIMITS = frozenset({"resource.setrlimit", "resource.prlimit"})
# event -> (positions of the paths it changes, position of its dir_fd or None)
_CHANGES_PATHS = {
    "os.remove": ((0,), 1), "os.rmdir": ((0,), 1), "os.mkdir": ((0,), 2), "os.rename": ((0, 1), 2),
    "os.link": ((0, 1), 2), "os.symlink": ((1,), 2), "os.chmod": ((0,), 2), "os.chown": ((0,), 3),
    "os.utime": ((0,), 3), "os.truncate": ((0,), None), "os.chflags": ((0,), None), "os.setxattr": ((0,), None),
    "os.removexattr": ((0,), None), "shutil.rmtree": ((0,), 1), "shutil.chown": ((0,), None),
    "shutil.move": ((0, 1), None), "shutil.copyfile": ((1,), None), "shutil.copymode": ((1,), None),
    "shutil.copystat": ((1,), None), "shutil.copytree": ((1,), None), "shutil.unpack_archive": ((1,), None),
    "shutil.make_archive": ((0,), None), "tempfile.mkstemp": ((0,), None), "tempfile.mkdtemp": ((0,), None),
    "sqlite3.connect": ((0,), None), "dbm.open": ((0,), None),  # files written from C
}


def _refuse(what: str):
    raise SandboxRefusal(f"the sandbox refuses {what}")


class _Guard:
    def __init__(self, workdir: str, pid_namespace: bool, private_proc: bool):
        self.workdir = os.path.realpath(workdir)
        self.pid_namespace = pid_namespace
        self.private_proc = private_proc
        self.pid = os.getpid()
        self.busy = threading.local()  # the hook's own file reads raise events too

    def __call__(self, event: str, args: tuple) -> None:
        if getattr(self.busy, "on", False):
            return
        self.busy.on = True
        try:
            self.check(event, args)
        finally:
            self.busy.on = False

    def check(self, event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = args
            if isinstance(path, int):
                return  # an open descriptor: its file was checked when it was opened
            if (flags or 0) & _WRITE_FLAGS or (mode and any(c in mode for c in "wax+")):
                if not self.writable(path):
                    _refuse(f"writing outside the call's directory ({self.workdir}): {os.fsdecode(path)}")
            elif not self.private_proc and self.other_process_entry(path):
                _refuse(f"reading another process's entry: {os.fsdecode(path)}")
        elif event in _CHANGES_PATHS:
            positions, dir_fd_at = _CHANGES_PATHS[event]
            dir_fd = args[dir_fd_at] if dir_fd_at is not None and dir_fd_at < len(args) else None
            for i in positions:
                if i < len(args) and not isinstance(args[i], int) and not self.writable(args[i], dir_fd):
                    _refuse(f"changing files outside the call's directory ({self.workdir}): {event}"
                            f"({os.fsdecode(args[i])})")
        elif event in _PROGRAMS:
            _refuse(f"starting programs ({event})")
        elif event == "socket.__new__":
            if args[1] != socket.AF_UNIX:
                _refuse("network access (socket)")
        elif event in _NETWORK:
            _refuse(f"network access ({event})")
        elif event in _C_FUNCTIONS:
            _refuse(f"C functions through ctypes ({event})")
        elif event in _LIMITS:
            _refuse(f"changing its limits ({event})")
        elif event in ("os.kill", "os.killpg") and not self.pid_namespace:
            target, sig = args
            if sig != 0 and not self.may_signal(target, group=event == "os.killpg"):
                _refuse(f"signalling a process outside the call ({event}: {target})")

    def resolve(self, path, dir_fd=None) -> str:
        path = os.fsdecode(path)
        if not os.path.isabs(path) and isinstance(dir_fd, int) and dir_fd >= 0:
            path = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
        return os.path.realpath(path)

    def writable(self, path, dir_fd=None) -> bool:
        if os.fsdecode(path) in _WRITABLE_ANYWHERE:
            return True
        real = self.resolve(path, dir_fd)
        return real == self.workdir or real.startswith(self.workdir + os.sep) or real in _WRITABLE_ANYWHERE

    def other_process_entry(self, path) -> bool:
        text = os.fsdecode(path)
        if "proc" not in text:
            return False
        parts = self.resolve(text).split(os.sep)
        return (len(parts) > 2 and parts[1] == "proc" and parts[2].isdigit()
                and not self.in_call(int(parts[2])))

    def in_call(self, pid: int) -> bool:
        """This process or one of its descendants (followed up the parent links, at most 64 of them)."""
        for _ in range(64):
            if pid == self.pid:
                return True
            if pid <= 1:
                return False
            try:
                with open(f"/proc/{pid}/stat", "rb") as f:
                    pid = int(f.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                return False
        return False

    def may_signal(self, target: int, group: bool) -> bool:
        if group:
            return target == 0 or target == os.getpgid(0) or self.in_call(target)
        if target == 0:
            return True  # its own process group
        if target == -1:
            return False  # every process it may signal
        return self.in_call(-target if target < 0 else target)


def install(workdir: str, pid_namespace: bool, private_proc: bool) -> None:
    """Refuse, from now on in this process and the processes it forks, what the module docstring lists.
    ``pid_namespace``: the call has a PID namespace of its own (no other process can be signalled);
    ``private_proc``: /proc is that namespace's (no other process's entry is in view)."""
    sys.addaudithook(_Guard(workdir, pid_namespace, private_proc))
