"""The trainer's checkpoints: what a checkpoint of a global step holds besides the policy, saving one, resuming
from the one ``trainer.resume`` names (falling back past checkpoints that cannot be loaded), and the marker that
asks the job script to requeue a preempted run. The files themselves are checkpoint.py's."""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Callable, TypeVar

from mcpo_megatron.config import Config, to_yaml
from mcpo_megatron.parallel.distributed import ParallelInfo, all_gather_objects, barrier
from mcpo_megatron.trainer import run_dir
from mcpo_megatron.trainer.checkpoint import (CheckpointLoadError, CheckpointManager, previous_complete,
                                              resolve_checkpoint, set_aside)
from mcpo_megatron.trainer.metrics import MetricsLogger

if TYPE_CHECKING:
    from mcpo_megatron.trainer.setup import TrainingSetup

PREEMPTED_FILE = "PREEMPTED"
T = TypeVar("T")


def checkpoint_manager(cfg: Config, info: ParallelInfo) -> CheckpointManager:
    """The run's checkpoints, under ``checkpoint.dir`` (default ``<trainer.output_dir>/checkpoints``)."""
    return CheckpointManager(run_dir.checkpoint_root(cfg), rank=info.rank, local_rank=info.local_rank,
                             keep_last=cfg.checkpoint.keep_last, barrier=barrier)


# ---------------------------------------------------------------------------------------------------- resuming
def restore_checkpoint(s: TrainingSetup, ckpt: CheckpointManager) -> tuple[Path | None, dict, dict | None]:
    """Collective: load the checkpoint ``trainer.resume`` names; returns its path, trainer state and this rank's
    RNG state ((None, {}, None): a fresh start). With ``trainer.resume=auto`` a complete checkpoint that cannot be
    loaded is reported and the previous complete one tried; once one loads, those that did not are set aside
    (``step_N.unloadable``), so that pruning never keeps them in place of good ones. An explicit path is not
    replaced: its error names the previous complete checkpoint."""
    cfg = s.cfg
    path = resume_point(cfg, ckpt)
    if path is None:
        return None, {}, None
    failed: list[tuple[Path, CheckpointLoadError]] = []
    while True:
        try:
            state, rng = restore(s, ckpt, path)
            break
        except CheckpointLoadError as e:
            failed.append((path, e))
            previous = ckpt.on_rank0(partial(previous_complete, path))
            if cfg.trainer.resume != "auto":
                advice = (f"the previous complete checkpoint is {previous}: pass trainer.resume={previous}"
                          if previous is not None else "there is no earlier complete checkpoint beside it")
                raise CheckpointLoadError(f"trainer.resume={cfg.trainer.resume}: {e}; {advice}") from None
            if previous is None:
                raise CheckpointLoadError(f"no complete checkpoint in {ckpt.root} can be loaded:\n" + "\n".join(
                    f"  {p.name}: {err}" for p, err in failed)) from None
            if s.info.rank == 0:
                print(f"warning: checkpoint {path} cannot be loaded ({e}); falling back to the previous complete "
                      f"checkpoint {previous}", flush=True)
            path = previous
    if s.info.rank == 0:
        for bad, _ in failed:
            print(f"moved the checkpoint that cannot be loaded to {set_aside(bad)}", flush=True)
    return path, state, rng


def resume_point(cfg: Config, ckpt: CheckpointManager) -> Path | None:
    """Collective: the checkpoint ``trainer.resume`` names, as rank 0 finds it on the file system: the latest one
    (auto), none (never), or the checkpoint at a path (a step_N directory, or the latest in a checkpoints
    directory)."""
    if cfg.trainer.resume == "never":
        return None
    if cfg.trainer.resume == "auto":
        return ckpt.latest()
    return ckpt.on_rank0(lambda: resolve_checkpoint(cfg.trainer.resume))


def restore(s: TrainingSetup, ckpt: CheckpointManager, checkpoint: Path) -> tuple[dict, dict | None]:
    """Collective: load the policy, the data sampler and the mastery tracker of ``checkpoint``; returns its trainer
    state and this rank's RNG state. Raises :class:`CheckpointLoadError` on every rank when any rank cannot read
    its files or load the policy."""
    state, rng = on_every_rank(lambda: ckpt.read_state(checkpoint), checkpoint)
    on_every_rank(lambda: s.policy.load_checkpoint(checkpoint / "policy"), checkpoint)
    s.sampler.load_state_dict(state["sampler"])
    s.tracker.load_state_dict(state["tracker"])
    return state, rng


def on_every_rank(load: Callable[[], T], checkpoint: Path) -> T:
    """Collective: ``load()``, and when it failed on any rank, :class:`CheckpointLoadError` on all of them (one
    object all-gather over the world: CPU, gloo), so that no rank goes on to a collective the others never reach.
    A file only some ranks read (this rank's RNG file) can fail on one rank; a failure inside megatron's policy load
    is raised on every rank by torch.distributed.checkpoint itself, before this gather."""
    result, error = None, None
    try:
        result = load()
    except Exception as e:  # noqa: BLE001  any failure to load is this checkpoint's, reported on every rank
        error = str(e) if isinstance(e, CheckpointLoadError) else f"{checkpoint}: {type(e).__name__}: {e}"
    gathered = all_gather_objects(error)
    errors = [(rank, err) for rank, err in enumerate(gathered) if err is not None]
    if errors:
        rank, err = errors[0]
        if len(gathered) > 1:
            err += f" (on rank {rank}" + (f" and {len(errors) - 1} other rank(s))" if len(errors) > 1 else ")")
        raise CheckpointLoadError(err)
    return result


# ---------------------------------------------------------------------------------------------------- saving
def trainer_state(s: TrainingSetup, step: int) -> dict:
    """What a checkpoint of ``step`` holds besides the policy: the data sampler, the mastery tracker and the
    schedule's state: the generation batches in flight (submitted ahead of their step with separate placement) and
    those already generated (``trainer/held_batches.py``), and with partial rollouts every unfinished response
    (``trainer/partial_schedule.py``)."""
    return {"step": step, "sampler": s.sampler.state_dict(), "tracker": s.tracker.state_dict(),
            **s.schedule.state_dict(step)}


def save_checkpoint(ckpt: CheckpointManager, s: TrainingSetup, step: int, state: dict,
                    rng_state: dict | None = None, *, log: MetricsLogger) -> float:
    """Collective: checkpoint ``step`` (the policy as it is now; ``rng_state``: this rank's RNG states to record,
    by default the current ones); returns the seconds it took."""
    t0 = time.perf_counter()
    with s.rollouts.training_state_resident():  # offloaded (trainer.offload): back on the GPU for the save
        ckpt.save(step, save_policy=s.policy.save_checkpoint, config_yaml=to_yaml(s.cfg), trainer_state=state,
                  rng_state=rng_state)
    seconds = time.perf_counter() - t0
    log.write(f"checkpoint step {step} saved in {seconds:.1f} s")
    return seconds


def mark_preempted(s: TrainingSetup, step: int) -> None:
    """The file the sbatch script reads to requeue the job (rank 0 writes it)."""
    if s.info.rank == 0:
        (Path(s.cfg.trainer.output_dir) / PREEMPTED_FILE).write_text(f"{step}\n")
