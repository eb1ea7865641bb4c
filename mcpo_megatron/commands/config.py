"""``mcpo config``: print the resolved config (defaults <- YAML <- overrides) and validate it for a world size."""

from __future__ import annotations

import os
import sys

from mcpo_megatron.config import (ConfigError, add_config_arguments, declared_world_size, derived, load_config,
                                  offload_enabled, presets, split_config_args, to_yaml, validate)


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
    print(f"# {describe_offload(cfg, check_devices=args.check_devices)}", file=sys.stderr)
    for w in warnings:
        print(f"warning: {w}", file=sys.stderr)
    print("config OK", file=sys.stderr)
    return 0


def describe_offload(cfg, *, check_devices: bool) -> str:
    """What ``trainer.offload.enable`` resolves to: on GPUs and on CPU, and with ``check_devices`` on this machine."""
    on = lambda cuda: "on" if offload_enabled(cfg, cuda=cuda) else "off"  # noqa: E731
    enable = cfg.trainer.offload.enable
    text = (f"trainer.offload.enable={'null' if enable is None else str(bool(enable)).lower()} resolves to "
            f"{on(True)} with GPUs, {on(False)} on CPU")
    if check_devices:
        from mcpo_megatron.config.validation import cuda_available

        text += f" (this machine: {on(cuda_available())})"
    return text
