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
crash or ``scancel`` mid-write leaves the previous checkpoint and ``latest`` untouched.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from mcpo_megatron.files import apply_umask

COMPLETE_MARKER = "COMPLETE"
LATEST_FILE = "latest"
_STEP_DIR = re.compile(r"^step_(\d{6,})$")


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


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def capture_rng_state() -> dict[str, Any]:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
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
    np.random.set_state(state["numpy"])
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
    a no-op in single-process tools).
    """

    def __init__(self, root: str | os.PathLike, *, rank: int, keep_last: int = 2,
                 barrier: Callable[[], None] = lambda: None):
        if keep_last < 1:
            raise ValueError(f"CheckpointManager: keep_last={keep_last} must be >= 1 (the latest is always kept)")
        self.root = Path(root)
        self.rank = rank
        self.keep_last = keep_last
        self.barrier = barrier

    def save(self, step: int, *, save_policy: Callable[[Path], None], trainer_state: dict[str, Any],
             config_yaml: str, rng_state: dict[str, Any] | None = None) -> Path:
        """Collective: write checkpoint ``step`` atomically and return its final path.

        ``rng_state`` is this rank's RNG state to record (default: the current one; the trainer passes the state
        of the step's start when it checkpoints in the middle of a step)."""
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
        torch.save(rng_state if rng_state is not None else capture_rng_state(),
                   tmp / "rng" / f"rank_{self.rank:05d}.pt")
        if self.rank == 0:
            torch.save(trainer_state, tmp / "trainer_state.pt")
            (tmp / "config.yaml").write_text(config_yaml)
        self.barrier()
        if self.rank == 0:
            meta = {"step": step, "time": time.time(), "seconds": round(time.time() - t0, 3)}
            _write_text_atomic(tmp / COMPLETE_MARKER, json.dumps(meta))
            apply_umask(tmp)  # readable by colleagues as a plain mkdir/open would make it
            _fsync_dir(tmp)
            if final.exists():  # a stale copy of the same step: replace it
                shutil.rmtree(final)
            os.replace(tmp, final)
            _fsync_dir(self.root)
            _write_text_atomic(self.root / LATEST_FILE, final.name + "\n")
            self._prune()
        self.barrier()
        return final

    def latest_step(self) -> int | None:
        """The step of the newest complete checkpoint (None when there is none)."""
        latest = find_latest(self.root)
        return None if latest is None else int(_STEP_DIR.match(latest.name).group(1))

    def _prune(self) -> None:
        complete = list_complete(self.root)
        for _, path in complete[: max(0, len(complete) - self.keep_last)]:
            shutil.rmtree(path, ignore_errors=True)
        for stale in self.root.glob("step_*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)

    def load_trainer_state(self, path: Path) -> dict[str, Any]:
        state = torch.load(path / "trainer_state.pt", weights_only=False)
        rng_file = path / "rng" / f"rank_{self.rank:05d}.pt"
        if rng_file.is_file():
            restore_rng_state(torch.load(rng_file, weights_only=False))
        return state


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
