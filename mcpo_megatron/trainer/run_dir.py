"""A run never writes into the directory of another run, and a run resumed from a path (``trainer.resume=PATH``)
finds a complete checkpoint there; both are checked before any process group starts.

A fresh run (``trainer.resume=never``) into a directory that holds a finished or stopped run would mix the two:
metrics.jsonl emptied, checkpoint pruning keeping the old run's higher steps and deleting the new ones, ``latest``
naming a deleted directory, and a later ``resume=auto`` continuing the old run. So such a directory is refused,
unless ``trainer.overwrite=true``: the old run is then moved aside to a timestamped sibling
(``<dir>.replaced-<YYYYmmdd-HHMMSS>``), never deleted.

Two runs at the same time in one directory (a job submitted twice, both with ``trainer.resume=auto``) would both
append step records and write checkpoints, and ``latest`` could go backwards. So trainer rank 0 holds a lock on
``trainer.output_dir`` (and on ``checkpoint.dir`` when it lies elsewhere) for the run's life, and a second run is
refused naming the holder (host, pid, SLURM job). The lock is a POSIX record lock (``fcntl.lockf``) on
``<dir>/run.lock``: the kernel drops it when the process ends, however it ends, so a crashed or killed job never
blocks its successor, and processes the rank forks do not inherit it. On NFS the lock is held by the server
(a crashed client's lock lasts until the server's lease expires, 90 s by default on NFSv4); on Lustre it is
cluster-wide with the ``flock`` mount option, per node with ``localflock``, and unavailable with neither: then the
run goes on with a warning, unprotected. A requeued SLURM job keeps its job id: it waits up to
``REQUEUE_WAIT_S`` for a lock its own previous attempt still holds (a lease running out), then is refused too.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from mcpo_megatron.config import ConfigError
from mcpo_megatron.parallel.distributed import ParallelInfo, broadcast_object
from mcpo_megatron.trainer.checkpoint import COMPLETE_MARKER, LATEST_FILE, find_latest, is_complete, list_complete

METRICS_FILE = "metrics.jsonl"
LOCK_FILE = "run.lock"
REQUEUE_WAIT_S = 180.0  # longer than an NFSv4 lease (90 s) and a Lustre client eviction (about 100 s)


def prepare_run_dir(cfg, info: ParallelInfo) -> list[RunLock]:
    """Collective, first thing in the trainer: rank 0 locks the run's directories for the run's life (refused while
    another run holds them), refuses a resume path without a checkpoint or a fresh run into another run's directory
    or, with trainer.overwrite, moves that run aside; returns rank 0's locks. Every rank gets the outcome, so all
    stop, with rank 0's error, or all go on."""
    refusal, locks = None, []
    if info.rank == 0:
        try:
            locks = lock_run_dirs(cfg)  # first: never move aside a directory a live run writes
            check_run_dir(cfg)
            moved = move_aside(cfg)
            for old, new in moved:
                print(f"trainer.overwrite=true: moved the run in {old} to {new}", flush=True)
            if moved:  # the lock files went with the old run: lock the new directories
                old_locks, locks = locks, []
                locks = lock_run_dirs(cfg)
                for lock in old_locks:
                    lock.release()
        except (ConfigError, RunDirInUse) as e:
            refusal = (type(e), e.problems if isinstance(e, ConfigError) else str(e))
        if refusal:
            for lock in locks:
                lock.release()
    refusal = broadcast_object(refusal)
    if refusal:
        error_type, detail = refusal
        raise error_type(detail)
    return locks


def checkpoint_root(cfg) -> Path:
    return Path(cfg.checkpoint.dir or Path(cfg.trainer.output_dir) / "checkpoints")


def run_contents(cfg) -> list[str]:
    """What in ``trainer.output_dir`` (and ``checkpoint.dir``) belongs to a run: step records in metrics.jsonl,
    complete checkpoints, a ``latest`` pointer. Empty when the directory holds no run."""
    found = []
    metrics = Path(cfg.trainer.output_dir) / METRICS_FILE
    if metrics.is_file():
        with open(metrics) as f:
            records = sum(1 for line in f if line.strip())
        if records:
            found.append(f"{metrics} ({records} step records)")
    root = checkpoint_root(cfg)
    steps = [step for step, _ in list_complete(root)]
    if steps:
        found.append(f"{len(steps)} checkpoint(s) in {root} (steps {', '.join(map(str, steps))})")
    elif (root / LATEST_FILE).is_file():
        found.append(f"{root / LATEST_FILE}")
    return found


def check_run_dir(cfg) -> None:
    """The rules of ``trainer.resume`` and ``trainer.output_dir`` that read the file system: raise ``ConfigError``
    for a resume path without a complete checkpoint, or a fresh run into another run's directory. Call it before
    any process group starts."""
    check_resume_path(cfg)
    check_fresh_run_dir(cfg)


def check_resume_path(cfg) -> None:
    """``trainer.resume`` other than auto / never must be a complete checkpoint or a directory holding one (a
    run's checkpoints/, whose latest is taken, as ``mcpo export`` and ``mcpo eval`` take it)."""
    resume = cfg.trainer.resume
    if resume in ("auto", "never"):
        return
    problem = _not_a_checkpoint(Path(resume))
    if problem:
        raise ConfigError(f"trainer.resume={resume}: {problem}; give a step_N checkpoint directory or a run's "
                          "checkpoints directory, or trainer.resume=auto (this run's latest) or never")


def _not_a_checkpoint(path: Path) -> str | None:
    """What keeps ``path`` from being a checkpoint to resume from (None: nothing)."""
    if not path.exists():
        return "no such directory"
    if not path.is_dir():
        return "a file, not a checkpoint directory"
    if is_complete(path) or find_latest(path) is not None:
        return None
    return (f"not a complete checkpoint: it has no {COMPLETE_MARKER} marker (a checkpoint whose writing did not "
            f"finish, or no checkpoint at all) and holds no step_N directory that has one")
def run_dirs(cfg) -> list[Path]:
    """``trainer.output_dir``, and ``checkpoint.dir`` when it is not inside it."""
    out, root = Path(cfg.trainer.output_dir), checkpoint_root(cfg)
    inside = root.resolve() == out.resolve() or out.resolve() in root.resolve().parents
    return [out] if inside else [out, root]


def check_fresh_run_dir(cfg) -> None:
    """Raise ``ConfigError`` when ``trainer.resume=never`` would write into the directory of another run and
    ``trainer.overwrite`` is off. Reads the file system only; call it before any process group starts."""
    if cfg.trainer.resume != "never" or cfg.trainer.overwrite:
        return
    found = run_contents(cfg)
    if found:
        raise ConfigError(
            f"trainer.output_dir={cfg.trainer.output_dir}: holds a run ({'; '.join(found)}) and trainer.resume=never "
            "starts a new one there; use trainer.resume=auto to continue it, trainer.overwrite=true to move it "
            "aside (to a timestamped sibling directory) first, or another trainer.output_dir")


def move_aside(cfg) -> list[tuple[Path, Path]]:
    """With ``trainer.resume=never`` and ``trainer.overwrite=true``: move a run found in ``trainer.output_dir``
    (and a ``checkpoint.dir`` outside it) to ``<dir>.replaced-<time>``. Returns the (old, new) paths moved.
    Call it on one rank, before any other rank writes there."""
    if cfg.trainer.resume != "never" or not cfg.trainer.overwrite or not run_contents(cfg):
        return []
    stamp = time.strftime("%Y%m%d-%H%M%S")
    moved = []
    for d in run_dirs(cfg):
        if not d.exists():
            continue
        dest = d.with_name(f"{d.name}.replaced-{stamp}")
        n = 1
        while dest.exists():
            dest = d.with_name(f"{d.name}.replaced-{stamp}-{n}")
            n += 1
        d.rename(dest)
        moved.append((d, dest))
    return moved


class RunDirInUse(RuntimeError):
    """Another live process holds the lock of a run directory."""


@dataclass
class RunLock:
    """The lock of one directory; ``fd`` is None where the file system cannot lock (the run goes on unprotected)."""

    path: Path
    fd: int | None

    def release(self) -> None:
        """Give the lock up (idempotent); the process's end does the same."""
        if self.fd is not None:
            _HELD.discard(_file_id(os.fstat(self.fd)))
            os.close(self.fd)  # closing the file drops this process's POSIX locks on it
            self.fd = None


# The lock files (device, inode) this process holds. POSIX locks of one process never conflict with each other,
# and closing any descriptor of a locked file drops the lock: so a second lock of a held file is refused before
# the file is opened.
_HELD: set[tuple[int, int]] = set()


def _file_id(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def lock_run_dirs(cfg) -> list[RunLock]:
    """Lock every directory the run writes (see the module's docstring); raises :class:`RunDirInUse`, naming the
    holder, when another run holds one. Call it on trainer rank 0 only."""
    locks: list[RunLock] = []
    try:
        for d in run_dirs(cfg):
            key = "trainer.output_dir" if d == Path(cfg.trainer.output_dir) else "checkpoint.dir"
            locks.append(lock_dir(d, key))
    except BaseException:
        for lock in locks:
            lock.release()
        raise
    return locks


def lock_dir(directory: Path, key: str = "trainer.output_dir", *, requeue_wait_s: float | None = None,
             poll_s: float = 2.0) -> RunLock:
    """Lock ``directory`` (created if missing) for this process; ``key`` names it in errors."""
    wait_s = REQUEUE_WAIT_S if requeue_wait_s is None else requeue_wait_s
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_FILE
    if path.exists() and _file_id(path.stat()) in _HELD:
        raise RunDirInUse(f"{key}={directory}: this process already holds {path}: one run per process")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except OSError as e:
            if e.errno not in (errno.EACCES, errno.EAGAIN):  # ENOLCK, ENOSYS, EOPNOTSUPP, EINVAL: no locking here
                os.close(fd)
                print(f"warning: cannot lock {path} ({e.strerror}): this file system does not support POSIX locks "
                      "(Lustre needs the flock mount option); a second run started in this directory would not be "
                      "refused", file=sys.stderr, flush=True)
                return RunLock(path, None)
            holder = _read_holder(path)
            if _same_slurm_job(holder) and time.monotonic() < deadline:
                time.sleep(poll_s)  # a requeue of this job: its previous attempt's lock is about to go
                continue
            os.close(fd)
            raise RunDirInUse(_in_use_message(key, directory, path, holder, wait_s)) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(_this_process()) + "\n").encode(), 0)
    os.fsync(fd)
    _HELD.add(_file_id(os.fstat(fd)))
    return RunLock(path, fd)


def _this_process() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            "slurm_restart_count": os.environ.get("SLURM_RESTART_COUNT"),
            "since": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def _read_holder(path: Path) -> dict:
    """What the holder wrote into the lock file ({} while it is writing, or if it could not)."""
    try:
        holder = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def _same_slurm_job(holder: dict) -> bool:
    job = os.environ.get("SLURM_JOB_ID")
    return bool(job) and holder.get("slurm_job_id") == job


def _in_use_message(key: str, directory: Path, path: Path, holder: dict, wait_s: float) -> str:
    if holder:
        who = f"host {holder.get('host')}, pid {holder.get('pid')}"
        if holder.get("slurm_job_id"):
            who += f", SLURM job {holder['slurm_job_id']}"
            if holder.get("slurm_restart_count"):
                who += f" (requeue {holder['slurm_restart_count']})"
        who += f", since {holder.get('since')}"
    else:
        who = "a process that has not written its name yet"
    end = f"scancel {holder['slurm_job_id']}" if holder.get("slurm_job_id") else f"kill {holder.get('pid', 'it')}"
    waited = (f" (this is a requeue of the same job: it waited {wait_s:.0f} s for its previous attempt to "
              "let go)" if _same_slurm_job(holder) else "")
    return (f"{key}={directory} is in use by another run: {who} (lock file {path}){waited}. Two runs in one "
            "directory would mix their step records and checkpoints: wait for that run to end (or end it: "
            f"{end}), or use another {key}")
