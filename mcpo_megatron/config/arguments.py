"""The ``CONFIG [key=value ...]`` arguments every config-reading command shares."""

from __future__ import annotations

from typing import Optional

from omegaconf import DictConfig

from mcpo_megatron.config.errors import ConfigError
from mcpo_megatron.config.loading import load_config

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
