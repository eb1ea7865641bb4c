"""``mcpo config`` and the ``CONFIG [key=value ...]`` arguments every config-reading command shares."""

from __future__ import annotations

import os
import sys
from typing import Optional

from omegaconf import DictConfig

from mcpo_megatron.config import presets
from mcpo_megatron.config.errors import ConfigError
from mcpo_megatron.config.loading import declared_world_size, load_config, to_yaml
from mcpo_megatron.config.validation import derived, validate

def add_config_arguments(parser) -> None:
    """Add ``CONFIG [key=value ...]`` positionals. Read them back with :func:`config_from_args`."""
    parser.add_argument("config_and_overrides", nargs="*", metavar="CONFIG [key=value ...]",
                        help="YAML config file (optional; defaults otherwise) followed by key=value overrides, "
                             "e.g. configs/qwen3_8b_mcpo.yaml rollout.n=8 eval.benchmarks=[aime24]")


def split_config_args(items: list[str]) -> tuple[Optional[str], list[str]]:
    """``[CONFIG, k=v, ...]`` -> (CONFIG or None, overrides). Only the first item may be a path."""
    items = list(items)
    path = items.pop(0) if items and "=" not in items[0] else None
    stray = [x for x in items if "=" not in x]
    if stray:
        raise ConfigError([f"argument {x!r}: only the first argument may be a config file; "
                           f"write overrides as key=value" for x in stray])
    return path, items


def config_from_args(args) -> DictConfig:
    path, overrides = split_config_args(args.config_and_overrides)
    return load_config(path, overrides)


# `mcpo config`: print the resolved config and validate it.

def add_parser(subparsers):
    p = subparsers.add_parser(
        "config", help="print the resolved config (defaults <- YAML <- overrides) and validate it",
        description="Print the resolved config as YAML and validate it for a world size. Exits 1 on a "
                    "violation, listing every one.")
    add_config_arguments(p)
    p.add_argument("--world-size", type=int, default=None,
                   help="number of ranks to validate for (default: the YAML's '# world_size: N' comment, "
                        "else WORLD_SIZE from the environment, else TP x PP)")
    p.add_argument("--check-devices", action="store_true",
                   help="also check the rules that need a GPU against this machine (imports torch)")
    return p


def run(args) -> int:
    try:
        path, overrides = split_config_args(args.config_and_overrides)
        cfg = load_config(path, overrides)
        world = args.world_size
        if world is None and path:
            world = declared_world_size(path)
        if world is None and os.environ.get("WORLD_SIZE", "").isdigit():
            world = int(os.environ["WORLD_SIZE"])
        if world is None:
            world = cfg.parallelism.tensor_model_parallel_size * cfg.parallelism.pipeline_model_parallel_size
        print(to_yaml(cfg), end="")
        warnings = validate(cfg, world, check_devices=args.check_devices)
    except ConfigError as e:
        print(f"mcpo config: {e}", file=sys.stderr)
        return 1
    d = derived(cfg, world)
    print(f"# world_size={world}: dp={d.dp} tp={d.tp} pp={d.pp} rollout_tp={d.rollout_tp}, "
          f"{d.optimizer_steps_per_global_step} optimizer step(s) per global step, "
          f"{d.sequences_per_global_step} sequences per global step, "
          f"{d.sequences_per_mini_batch_per_dp_rank:g} per DP rank per mini-batch", file=sys.stderr)
    print(f"# {presets.describe(cfg.algorithm)}", file=sys.stderr)
    for w in warnings:
        print(f"warning: {w}", file=sys.stderr)
    print("config OK", file=sys.stderr)
    return 0
