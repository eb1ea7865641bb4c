"""The ``mcpo`` command: a table of subcommands, each in its own module of :mod:`mcpo_megatron.commands`.

This is the package's one program: ``mcpo COMMAND ...`` on a login node, ``python -m mcpo_megatron.cli COMMAND
...`` under torchrun or srun (every rank runs the same command). Contract for a subcommand module (listed in
``SUBCOMMANDS``):

    def add_parser(subparsers) -> argparse.ArgumentParser:
        p = subparsers.add_parser("<name>", help=..., description=...)   # <name> as in SUBCOMMANDS
        ...                                                               # its own arguments
        return p

    def run(args: argparse.Namespace) -> int:                             # exit status
        ...

Modules are imported only when their subcommand is chosen, so ``mcpo --help`` is instant and never imports
torch or megatron. Subcommands that read a config should use ``mcpo_megatron.config.add_config_arguments``
and ``config_from_args`` so that every command takes ``CONFIG [key=value ...]`` the same way.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback
from typing import Optional, Sequence

# name -> (module, one-line help). Order is the order of `mcpo --help`.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "train": ("mcpo_megatron.commands.train", "train a policy (MCPO, DAPO, GRPO, ...) from CONFIG [key=value ...]"),
    "demo": ("mcpo_megatron.commands.demo", "the embedded default job: MCPO vs DAPO on CPU, curves and a table"),
    "selftest": ("mcpo_megatron.commands.selftest",
                 "check a new allocation: GPUs, collectives, layers, engine, a step"),
    "config": ("mcpo_megatron.commands.config", "print the resolved config and validate it for a world size"),
    "plan": ("mcpo_megatron.commands.plan", "check a parallel layout for a cluster shape and estimate GPU memory"),
    "check-model": ("mcpo_megatron.commands.check_model",
                    "check the Megatron model against Hugging Face (weights, logits)"),
    "check-rollout": ("mcpo_megatron.commands.check_rollout", "check the rollout engine and weight resharding"),
    "eval": ("mcpo_megatron.commands.eval", "evaluate a model or checkpoint on benchmarks (pass@1 / pass@k)"),
    "export": ("mcpo_megatron.commands.export", "export a training checkpoint to Hugging Face safetensors"),
    "report": ("mcpo_megatron.commands.report", "summarise runs: metrics, curves, scaling tables"),
}

PROG = "mcpo"


def _top_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="mcpo-megatron: RL for reasoning LLMs (MCPO, GRPO, DAPO, Dr.GRPO, GSPO, GCPO) on "
                    "Megatron-core TP x PP x DP.",
        epilog=f"Run '{PROG} COMMAND --help' for the options of one command.")
    from mcpo_megatron import __version__  # the package __init__ is import-free

    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subs = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for name, (_, help_line) in SUBCOMMANDS.items():
        subs.add_parser(name, help=help_line, add_help=False)
    return parser


def _import_subcommand(name: str):
    """Import the module of subcommand ``name``; returns (module, None) or (None, error message)."""
    module_name = SUBCOMMANDS[name][0]
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        missing = getattr(e, "name", None)
        if missing and (module_name == missing or module_name.startswith(missing + ".")):
            return None, (f"{PROG} {name}: this command is not available in this installation "
                          f"(module {module_name} is missing)")
        return None, (f"{PROG} {name}: cannot import {module_name}: {e}. Install the missing package "
                      f"(e.g. pip install -e '.[dev]'), or set MCPO_DEBUG=1 for the traceback")
    except Exception as e:  # a broken module must not show a bare traceback to users
        return None, (f"{PROG} {name}: importing {module_name} failed: {type(e).__name__}: {e} "
                      f"(set MCPO_DEBUG=1 for the traceback)")
    for attr in ("add_parser", "run"):
        if not callable(getattr(module, attr, None)):
            return None, f"{PROG} {name}: module {module_name} has no {attr}() function"
    return module, None


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    top = _top_parser()
    if not argv or argv[0] not in SUBCOMMANDS:
        if not argv:
            top.print_help()
            return 2
        try:
            top.parse_args(argv)  # prints help for -h, or a usage error for an unknown command
        except SystemExit as e:
            return int(e.code or 0)
        return 2

    name = argv[0]
    module, error = _import_subcommand(name)
    if module is None:
        if os.environ.get("MCPO_DEBUG"):
            traceback.print_exc()
        print(error, file=sys.stderr)
        return 1

    parser = argparse.ArgumentParser(prog=PROG)
    subs = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    module.add_parser(subs)
    if name not in subs.choices:
        print(f"{PROG} {name}: {SUBCOMMANDS[name][0]}.add_parser() did not register a '{name}' subcommand "
              f"(it registered {sorted(subs.choices)})", file=sys.stderr)
        return 1
    try:
        args, extra = parser.parse_known_args(argv)
        # key=value overrides may also follow --options (argparse stops the positionals at the first option)
        stray = [x for x in extra if x.startswith("-") or "=" not in x]
        if stray or (extra and not hasattr(args, "config_and_overrides")):
            parser.error(f"unrecognized arguments: {' '.join(stray or extra)}")
        if extra:
            args.config_and_overrides = [*args.config_and_overrides, *extra]
    except SystemExit as e:  # --help or a usage error (argparse already printed it)
        return int(e.code or 0)
    result = module.run(args)
    return int(result or 0)


if __name__ == "__main__":  # required: dist_checkpointing and the reward workers start processes
    sys.exit(main())
