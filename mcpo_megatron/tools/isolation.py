"""What the kernel does to confine a tool call (Linux): namespaces, a read-only file system around a fresh
directory, a private /proc, no capabilities, death with the parent.

A call's supervisor enters new user (when it may), mount, network, PID and IPC namespaces: the call's processes
then see no network interface but a loopback that is down, no process but their own (the first is PID 1 of its
namespace: when it ends, the kernel kills the rest), and a file system that is read-only everywhere except a
tmpfs at the call's directory, which vanishes with the namespace. The code's own process then drops every
capability and sets no_new_privs, so nothing it runs can undo any of this (remount, raise a limit, gain
privileges through a setuid binary). An unprivileged user gets all of it from a user namespace where the kernel
allows one; root gets it without.

Every function raises OSError naming the operation that failed; the supervisor degrades without it (noting
what is missing). ctypes handles are made per use and dropped, so the code (a fork of this process, whose audit
hook refuses loading C functions) finds none ready in memory.
"""

from __future__ import annotations

import ctypes
import os
import signal

CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_RELATIME, MS_STRICTATIME = 1024, 2048, 1 << 21, 1 << 24
# Options a remount must repeat: in a user namespace they are locked, and a remount without them is refused.
_MOUNT_OPTIONS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
                  "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME, "strictatime": MS_STRICTATIME}

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38

SYS_MOUNT_SETATTR = 442  # the same number on every architecture (added in Linux 5.12)
AT_FDCWD = -100
AT_RECURSIVE = 0x8000
MOUNT_ATTR_RDONLY = 0x1
_LINUX_CAPABILITY_VERSION_3 = 0x20080522


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64), ("propagation", ctypes.c_uint64),
                ("userns_fd", ctypes.c_uint64)]


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _prctl(option: int, value: int, what: str) -> None:
    libc = _libc()
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    _check(libc.prctl(option, value, 0, 0, 0), what)


def die_with_parent() -> None:
    """SIGKILL this process when its parent ends (checked by the caller against a parent already gone)."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL, "prctl(PR_SET_PDEATHSIG)")


def become_subreaper() -> None:
    """Orphaned descendants are re-parented to this process instead of init, so none leaves its tree."""
    _prctl(PR_SET_CHILD_SUBREAPER, 1, "prctl(PR_SET_CHILD_SUBREAPER)")


def enter_namespaces(user: bool) -> None:
    """New mount, network, PID (for the children to come) and IPC namespaces, in a new user namespace where this
    process is root when ``user`` (mapped to its own uid and gid: no other id is needed or granted)."""
    uid, gid = os.getuid(), os.getgid()
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | (CLONE_NEWUSER if user else 0)
    _check(_libc().unshare(flags), "unshare")
    if user:
        for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)


def _mount(source, target, fstype, flags: int, data, what: str) -> None:
    libc = _libc()
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    enc = lambda s: None if s is None else os.fsencode(s)  # noqa: E731
    _check(libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)), what)


def _mount_points() -> list[tuple[str, int]]:
    """(mount point, flags to repeat) of every mount of this namespace, parents first (/proc/self/mountinfo)."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            point = fields[4].encode().decode("unicode_escape")  # \040 and the like
            flags = sum(_MOUNT_OPTIONS.get(o, 0) for o in fields[5].split(","))
            out.append((point, flags))
    return out


def _all_read_only() -> None:
    """Every mount of this (new, private) mount namespace read-only: one recursive mount_setattr, or one
    remount per mount point on kernels older than 5.12."""
    libc = _libc()
    attr = _MountAttr(MOUNT_ATTR_RDONLY, 0, 0, 0)
    result = libc.syscall(ctypes.c_long(SYS_MOUNT_SETATTR), ctypes.c_int(AT_FDCWD), ctypes.c_char_p(b"/"),
                          ctypes.c_uint(AT_RECURSIVE), ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)))
    if result == 0:
        return
    err = ctypes.get_errno()
    if err != 38:  # ENOSYS: an older kernel, remount each mount
        raise OSError(err, f"mount_setattr(/, read-only, recursive): {os.strerror(err)}")
    for point, flags in _mount_points():
        _mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | flags, None, f"remount {point} read-only")


def confine_filesystem(workdir: str, disk_mb: int) -> None:
    """In the new mount namespace: nothing propagates out, every mount is read-only, and ``workdir`` is a fresh
    tmpfs of at most ``disk_mb`` MiB where nothing can be executed; so is /dev/shm, where multiprocessing's
    semaphores live."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE, None, "mount --make-rprivate /")
    _all_read_only()
    for point, mode in ((workdir, "0700"), ("/dev/shm", "1777")):
        if point == workdir or os.path.isdir(point):
            _mount("tmpfs", point, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, f"mode={mode},size={disk_mb}m",
                   f"mount tmpfs on {point}")


def mount_private_proc() -> None:
    """A read-only /proc of this process's PID namespace: the call sees its own processes only (called by the
    namespace's first process)."""
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY, None, "mount proc on /proc")


def drop_privileges() -> None:
    """No capability left (effective, permitted, inheritable) and no_new_privs: no exec can give any back."""
    libc = _libc()
    header, data = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0), (_CapData * 2)()
    _check(libc.capset(ctypes.byref(header), data), "capset(none)")
    _prctl(PR_SET_NO_NEW_PRIVS, 1, "prctl(PR_SET_NO_NEW_PRIVS)")
