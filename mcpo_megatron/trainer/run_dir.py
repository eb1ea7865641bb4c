"""A fresh run (``trainer.resume=never``) never writes into the directory of another run, and a run resumed from
a path (``trainer.resume=PATH``) finds a complete checkpoint there; both are checked before any process starts.

Writing into it would mix two runs: metrics.jsonl emptied, checkpoint pruning keeping the old run's higher
steps and deleting the new ones, ``latest`` naming a deleted directory, and a later ``resume=auto``
continuing the old run. So such a directory is refused, unless ``trainer.overwrite=true``: the old run is
then moved aside to a timestamped sibling (``<dir>.replaced-<YYYYmmdd-HHMMSS>``), never deleted.
"""

from __future__ import annotations

import time
from pathlib import Path

from mcpo_megatron.config import ConfigError
from mcpo_megatron.trainer.checkpoint import COMPLETE_MARKER, LATEST_FILE, find_latest, is_complete, list_complete

METRICS_FILE = "metrics.jsonl"


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
    out = Path(cfg.trainer.output_dir)
    dirs = [out]
    root = checkpoint_root(cfg)
    if root.resolve() != out.resolve() and out.resolve() not in root.resolve().parents:
        dirs.append(root)
    moved = []
    for d in dirs:
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
