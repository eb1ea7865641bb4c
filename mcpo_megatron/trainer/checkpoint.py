"""Atomic, resumable checkpoints.

Layout under ``checkpoint.dir``::

    step_000004/            one complete checkpoint
        policy/             model + optimizer + scheduler (megatron dist_checkpointing, written by all ranks)
        trainer_state.pt    step, data sampler, mastery tracker, metrics carried between steps (rank 0)
        rng/rank_00000.pt   python / numpy / torch / CUDA RNG states of each rank
        config.yaml         the resolved config of the run
        COMPLETE            written last: a directory without it is never used
    latest                  text file naming the newest complete checkpoint, replaced atomically

A checkpoint is written into ``step_000004.tmp`` and renamed once every rank has finished writing, so a
crash or ``scancel`` mid-write leaves the previous checkpoint and ``latest`` untouched. Every file and directory is
fsynced before the COMPLETE marker is written, so a node crash cannot leave a marked checkpoint with a file still
in the page cache.

``trainer_state.pt`` and the RNG files hold only tensors and plain Python values (dict, list, tuple, str, int,
float, bool, None) and are loaded with ``torch.load(weights_only=True)``: a forged file cannot run code when it is
loaded. The policy's metadata is read by megatron-core and torch.distributed.checkpoint with pickle: load
checkpoints only from a trusted source.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import shutil
import time
from pathlib import Path
from typing import Any, Callable, TypeVar

import numpy as np
import torch

from mcpo_megatron.files import apply_umask
from mcpo_megatron.parallel.distributed import broadcast_object

COMPLETE_MARKER = "COMPLETE"
LATEST_FILE = "latest"
_STEP_DIR = re.compile(r"^step_(\d{6,})$")
T = TypeVar("T")


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def is_complete(path: str | os.PathLike) -> bool:
    """A checkpoint directory counts only when its COMPLETE marker exists and parses."""
    marker = Path(path) / COMPLETE_MARKER
    try:
        meta = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and "step" in meta


def list_complete(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``root`` as (step, path), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        m = _STEP_DIR.match(child.name)
        if m and child.is_dir() and is_complete(child):
            found.append((int(m.group(1)), child))
    return sorted(found)


def find_latest(root: str | os.PathLike) -> Path | None:
    """The checkpoint named by ``latest`` if it is complete, else the newest complete one, else None."""
    root = Path(root)
    pointer = root / LATEST_FILE
    if pointer.is_file():
        candidate = root / pointer.read_text().strip()
        if candidate.name and is_complete(candidate):
            return candidate
    complete = list_complete(root)
    return complete[-1][1] if complete else None


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_tree(root: Path) -> None:
    """fsync every file under ``root``, then every directory, deepest first (so each new entry is durable)."""
    dirs = [root]
    for dirpath, dirnames, filenames in os.walk(root):
        dirs += [Path(dirpath) / d for d in dirnames]
        for name in filenames:
            if not os.path.islink(os.path.join(dirpath, name)):
                _fsync_file(Path(dirpath) / name)
    for d in sorted(set(dirs), key=lambda p: len(p.parts), reverse=True):
        _fsync_dir(d)


# Exact types: subclasses (numpy.float64 is a float) pickle as themselves, and a safe load refuses them.
PLAIN_TYPES = (dict, list, tuple, str, int, float, bool, type(None))


def check_plain(value: Any, where: str) -> None:
    """Raise ``TypeError`` naming the first value under ``where`` that ``torch.load(weights_only=True)`` would
    refuse: a checkpoint holds only tensors and plain Python values, so that loading one runs no code."""
    if type(value) not in PLAIN_TYPES and not isinstance(value, torch.Tensor):
        raise TypeError(f"{where}: {type(value).__module__}.{type(value).__qualname__} cannot go into a checkpoint "
                        "(it holds only tensors, dict, list, tuple, str, int, float, bool and None, so that loading "
                        "it runs no code); convert it, e.g. a numpy value with .tolist() or torch.as_tensor")
    if isinstance(value, dict):
        for k, v in value.items():
            check_plain(k, f"{where} (key {k!r})")
            check_plain(v, f"{where}[{k!r}]")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check_plain(v, f"{where}[{i}]")


class CheckpointLoadError(RuntimeError):
    """A checkpoint file that cannot be read: truncated, damaged, or holding more than tensors and plain values."""


def load_plain(path: Path) -> Any:
    """``torch.load(path, weights_only=True)``, with an error naming the file when it cannot be read."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if "Weights only load failed" in str(e):
            reason = next((line for line in str(e).splitlines() if "WeightsUnpickler error: " in line), str(e))
            reason = reason.split("WeightsUnpickler error: ")[-1].split(". Please use")[0].strip()
            raise CheckpointLoadError(
                f"{path}: refused: a checkpoint file holds only tensors and plain Python values, and this one holds "
                f"more, which loading would run ({reason}); it was not written by this trainer or was altered. "
                "Load checkpoints only from a trusted source") from None
        raise CheckpointLoadError(f"{path}: unreadable ({type(e).__name__}: {e})") from e
    except Exception as e:  # truncated or damaged: torch raises RuntimeError, EOFError, ...
        raise CheckpointLoadError(f"{path}: unreadable ({type(e).__name__}: {e})") from e


def _save_synced(obj: Any, path: Path) -> None:
    torch.save(obj, path)
    _fsync_file(path)


def _write_text_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def capture_rng_state() -> dict[str, Any]:
    """This rank's RNG states, as tensors and plain values (see :func:`check_plain`)."""
    name, key, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    state = {
        "python": random.getstate(),
        "numpy": {"bit_generator": name, "key": key.tolist(), "pos": int(pos), "has_gauss": int(has_gauss),
                  "cached_gaussian": float(cached_gaussian)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:  # megatron's model-parallel RNG tracker (dropout in TP regions)
        from megatron.core import tensor_parallel

        state["megatron_tracker"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    except Exception:
        pass
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    # A tuple is numpy's own state, as checkpoints written before the plain form hold it (they still load in the
    # trainer: megatron-core allows numpy arrays in weights-only loads).
    n = state["numpy"]
    if isinstance(n, dict):
        n = (n["bit_generator"], np.asarray(n["key"], dtype=np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    np.random.set_state(n)
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "megatron_tracker" in state:
        try:
            from megatron.core import tensor_parallel

            tensor_parallel.get_cuda_rng_tracker().set_states(state["megatron_tracker"])
        except Exception:
            pass


class CheckpointManager:
    """Writes and finds checkpoints; every rank calls every method (collective where noted).

    ``barrier`` is a callable that synchronises all ranks (``torch.distributed.barrier`` in training,
    a no-op in single-process tools). ``local_rank``: the rank on its node; local rank 0 of every node fsyncs the
    checkpoint's files, which flushes what that node's ranks wrote (a file's dirty pages belong to the node that
    wrote it, also on NFS and Lustre clients).

    Which checkpoints exist decides the collectives every rank enters next (whether to save, which checkpoint to
    load), and on a shared file system one node's view can lag another's (NFS attribute and directory caches):
    so rank 0 alone reads it and every rank follows rank 0 (:meth:`on_rank0`).
    """

    def __init__(self, root: str | os.PathLike, *, rank: int, local_rank: int = 0, keep_last: int = 2,
                 barrier: Callable[[], None] = lambda: None):
        if keep_last < 1:
            raise ValueError(f"CheckpointManager: keep_last={keep_last} must be >= 1 (the latest is always kept)")
        self.root = Path(root)
        self.rank = rank
        self.local_rank = local_rank
        self.keep_last = keep_last
        self.barrier = barrier

    def save(self, step: int, *, save_policy: Callable[[Path], None], trainer_state: dict[str, Any],
             config_yaml: str, rng_state: dict[str, Any] | None = None) -> Path:
        """Collective: write checkpoint ``step`` atomically and return its final path.

        ``rng_state`` is this rank's RNG state to record (default: the current one; the trainer passes the state
        of the step's start when it checkpoints in the middle of a step)."""
        rng_state = rng_state if rng_state is not None else capture_rng_state()
        check_plain(trainer_state, "trainer_state")  # on every rank, before the first barrier: all raise or none
        check_plain(rng_state, "rng_state")
        final = self.root / step_dir_name(step)
        tmp = self.root / (step_dir_name(step) + ".tmp")
        t0 = time.time()
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():  # left by an interrupted save of the same step
                shutil.rmtree(tmp)
            (tmp / "rng").mkdir(parents=True)
        self.barrier()
        save_policy(tmp / "policy")
        _save_synced(rng_state, tmp / "rng" / f"rank_{self.rank:05d}.pt")
        if self.rank == 0:
            _save_synced(trainer_state, tmp / "trainer_state.pt")
            _write_text_synced(tmp / "config.yaml", config_yaml)
        self.barrier()
        if self.rank == 0:
            apply_umask(tmp)  # readable by colleagues as a plain mkdir/open would make it
        if self.local_rank == 0:  # the policy's files, written by megatron on every rank of this node
            _fsync_tree(tmp)
        self.barrier()
        if self.rank == 0:
            meta = {"step": step, "time": time.time(), "seconds": round(time.time() - t0, 3)}
            _write_text_atomic(tmp / COMPLETE_MARKER, json.dumps(meta))
            if final.exists():  # a stale copy of the same step: replace it
                shutil.rmtree(final)
            os.replace(tmp, final)
            _fsync_dir(self.root)
            _write_text_atomic(self.root / LATEST_FILE, final.name + "\n")
            self._prune()
        self.barrier()
        return final

    def on_rank0(self, read: Callable[[], T]) -> T:
        """Collective: what ``read()`` returns on rank 0, on every rank (the others do not call it), or the
        exception it raised, raised on every rank. One object broadcast over the world (``broadcast_object``: on a
        GPU run too it goes over gloo, the default group's backend for CPU objects); a no-op without a process
        group."""
        outcome, own_error = None, None
        if self.rank == 0:
            try:
                outcome = (read(), None)
            except Exception as e:  # noqa: BLE001  every rank raises it
                own_error = e
                outcome = (None, e if _picklable(e) else RuntimeError(f"{type(e).__name__}: {e}"))
        value, error = broadcast_object(outcome)
        if error is not None:
            raise own_error or error
        return value

    def latest(self) -> Path | None:
        """Collective: the newest complete checkpoint (:func:`find_latest`) as rank 0 finds it; None: none."""
        return self.on_rank0(lambda: find_latest(self.root))

    def latest_step(self) -> int | None:
        """Collective: the step of the newest complete checkpoint as rank 0 finds it (None when there is none)."""
        latest = self.latest()
        return None if latest is None else int(_STEP_DIR.match(latest.name).group(1))

    def _prune(self) -> None:
        complete = list_complete(self.root)
        for _, path in complete[: max(0, len(complete) - self.keep_last)]:
            shutil.rmtree(path, ignore_errors=True)
        for stale in self.root.glob("step_*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)

    def read_state(self, path: Path) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """This rank's view of checkpoint ``path``: the trainer state and this rank's RNG state (None when the
        checkpoint has no file for this rank). Reads files only (no collective); raises
        :class:`CheckpointLoadError` naming the file that cannot be read."""
        if not is_complete(path):
            raise CheckpointLoadError(f"{path}: not a complete checkpoint (no readable {COMPLETE_MARKER} marker: "
                                      "the save was interrupted, or this is not a step_N checkpoint directory)")
        state = load_plain(path / "trainer_state.pt")
        rng_file = path / "rng" / f"rank_{self.rank:05d}.pt"
        return state, load_plain(rng_file) if rng_file.is_file() else None


def _picklable(value: Any) -> bool:
    try:
        pickle.dumps(value)
    except Exception:  # noqa: BLE001  any failure to pickle
        return False
    return True


def previous_complete(path: Path) -> Path | None:
    """The newest complete checkpoint beside ``path`` with a lower step (None when there is none)."""
    m = _STEP_DIR.match(path.name)
    if m is None:
        return None
    earlier = [p for step, p in list_complete(path.parent) if step < int(m.group(1))]
    return earlier[-1] if earlier else None


def set_aside(path: Path) -> Path:
    """Rename a checkpoint that cannot be loaded to ``<name>.unloadable`` (kept for inspection; pruning and
    ``latest`` no longer see it, so it never displaces a good checkpoint). Returns the new path."""
    dest = path.with_name(path.name + ".unloadable")
    n = 1
    while dest.exists():
        dest = path.with_name(f"{path.name}.unloadable-{n}")
        n += 1
    path.rename(dest)
    _fsync_dir(path.parent)
    return dest


def resolve_checkpoint(path: str) -> Path:
    """``path`` if it is a complete checkpoint, else the latest complete one under it (``mcpo export`` and
    ``mcpo eval`` take either)."""
    p = Path(path)
    if is_complete(p):
        return p
    latest = find_latest(p)
    if latest is None:
        raise FileNotFoundError(f"{path} is neither a complete checkpoint (with a COMPLETE marker) nor a directory "
                                "holding one; point it at runs/<name>/checkpoints or a step_N directory")
    return latest
