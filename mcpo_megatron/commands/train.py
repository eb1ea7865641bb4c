"""``mcpo train CONFIG [key=value ...]``, also under torchrun or srun (``-m mcpo_megatron.cli train ...``).

Every rank runs this same program. The config is loaded and validated before any process group exists,
so a bad config fails in seconds with every violation listed. Started without a launcher (no RANK or
SLURM_PROCID in the environment), ``mcpo train`` starts torchrun itself with ``--nproc`` processes
(default: the config's ``# world_size: N`` line, else TP x PP).
"""

from __future__ import annotations

import argparse
import sys

from mcpo_megatron.config import (ConfigError, add_config_arguments, declared_world_size, load_config,
                                  split_config_args, validate)
from mcpo_megatron.trainer.run_dir import check_run_dir


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "train", help="train a policy (MCPO, DAPO, GRPO, ...) from CONFIG [key=value ...]",
        description="Train with the configured algorithm. Under torchrun/srun every rank runs this; started "
                    "directly it launches torchrun with --nproc processes on this machine.",
        epilog="example: mcpo train configs/cpu_smollm2_arith.yaml trainer.total_steps=5")
    add_config_arguments(p)
    p.add_argument("--nproc", type=int, default=None,
                   help="processes to start when not under a launcher (default: the config's world size)")
    return p


def _launch_local(args) -> int:
    """Validate for the world size, then re-run this program under torchrun on this machine: a bad config fails
    here, once, before any process starts."""
    from mcpo_megatron.parallel.distributed import run_under_torchrun

    path, overrides = split_config_args(args.config_and_overrides)
    cfg = load_config(path, overrides)
    nproc = args.nproc or (declared_world_size(path) if path else None) or (
        cfg.parallelism.tensor_model_parallel_size * cfg.parallelism.pipeline_model_parallel_size
        + (cfg.rollout.ranks if cfg.rollout.placement == "separate" else 0))
    validate(cfg, nproc, check_devices=True)
    check_run_dir(cfg)
    return run_under_torchrun(["train", *args.config_and_overrides], nproc)


def role_world_timeout_s(cfg, role: str) -> float:
    """The collective timeout of a role's world (separate placement). Engine replicas wait for each other within a
    batch, so the engine world's derives from ``rollout.batch_timeout_s``; no collective of the trainer world
    waits on the engines (the trainer ranks wait for their leader in a group of their own,
    ``rollout/separate/remote.RemoteRollouts``), so it keeps the default, as megatron's groups do."""
    from mcpo_megatron.parallel.bridge import ROLLOUT
    from mcpo_megatron.parallel.distributed import DEFAULT_TIMEOUT_S
    from mcpo_megatron.rollout.separate.liveness import Waits

    return Waits.from_config(cfg).engine_world_s if role == ROLLOUT else DEFAULT_TIMEOUT_S


def run(args) -> int:
    from mcpo_megatron.parallel.distributed import under_launcher

    if not under_launcher():
        try:
            return _launch_local(args)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    from mcpo_megatron.parallel.launcher import launcher_env

    rank, world_size, _ = launcher_env()
    path, overrides = split_config_args(args.config_and_overrides)
    try:
        cfg = load_config(path, overrides)
        warnings = validate(cfg, world_size, check_devices=True)
        check_run_dir(cfg)  # every rank reads the same directories: all of them stop, before any group
    except ConfigError as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr)
        return 1
    if rank == 0:
        for w in warnings:
            print(f"warning: {w}", file=sys.stderr)

    from mcpo_megatron.parallel.distributed import destroy_distributed, init_distributed
    from mcpo_megatron.reaper import start_reaper
    from mcpo_megatron.trainer.loop import train
    from mcpo_megatron.trainer.startup import StartupClock

    clock = StartupClock()
    clock.mark("imports")  # and the interpreter's start and the config's validation

    reaper = start_reaper()  # noqa: F841  kills what this rank leaves behind if it dies (reward workers, writers)
    bridge = None
    if cfg.rollout.placement == "separate":  # the last rollout.ranks ranks run engines, in a world of their own
        from mcpo_megatron.parallel.bridge import ROLLOUT, split_roles, start_role_world
        from mcpo_megatron.parallel.distributed import default_backend

        import torch

        roles = split_roles(rank, world_size, cfg.rollout.ranks)
        bridge = start_role_world(roles, default_backend(torch.cuda.is_available()),
                                  timeout_s=role_world_timeout_s(cfg, roles.role))
        if roles.role == ROLLOUT:
            from mcpo_megatron.trainer.rollout_worker import serve_rollouts

            try:
                serve_rollouts(cfg, roles, bridge)
            finally:
                destroy_distributed()
            return 0
    p = cfg.parallelism
    info = init_distributed(p.tensor_model_parallel_size, p.pipeline_model_parallel_size, seed=cfg.trainer.seed,
                            ep=p.expert_model_parallel_size, vpp=p.virtual_pipeline_model_parallel_size,
                            cp=p.context_parallel_size)
    clock.mark("process groups")
    try:
        train(cfg, info, bridge, clock)
    finally:
        destroy_distributed()
    return 0

