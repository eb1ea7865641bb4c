"""``mcpo report RUN_DIR... --out DIR``: tables and figures comparing training runs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "report", help="summarise runs: metrics, curves, scaling tables",
        description="Read run directories (metrics.jsonl, config.yaml, summary.json, eval_results.json) and "
                    "write DIR/report.md with a throughput table per sweep axis (step time split, tokens/s/GPU, "
                    "MFU, scaling efficiency, peak memory), learning and retention tables, the final evaluation "
                    "table and PNG figures. Runs are labelled by the config keys that differ between them. Runs "
                    "that differ only in trainer.seed / rollout.seed / data.seed are grouped as replicates: every "
                    "table then shows mean +- the half-width of the Student-t interval over seeds, the figures "
                    "draw bands, and a table gives each group's difference from a reference group (Welch "
                    "interval). A directory without metrics.jsonl is searched one level down (a sweep directory).")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories, or a sweep directory")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory for report.md and the PNGs")
    p.add_argument("--warmup-steps", type=int, default=1,
                   help="steps left out of the means (compilation, allocator warm-up); default 1")
    p.add_argument("--title", default="Run report", help="the report's title")
    p.add_argument("--note", default=None, help="a paragraph put under the title (e.g. 'CPU runs')")
    p.add_argument("--last-steps", type=int, default=1, metavar="N",
                   help="the learning table averages each run's last N logged values of a curve (default 1: the "
                        "last value; a window smooths the step-to-step noise of small batches)")
    p.add_argument("--confidence", type=float, default=0.95, help="confidence level of every interval (default 0.95)")
    p.add_argument("--reference", default=None, metavar="GROUP",
                   help="the seed group the differences table compares against: its label or a unique part of it, "
                        "e.g. dapo (default: the first group)")
    return p


def expand_run_dirs(paths: list[str]) -> list[Path]:
    """Run directories as given; a directory without metrics.jsonl stands for its subdirectories that have
    one (a sweep directory), in name order."""
    out: list[Path] = []
    for p in map(Path, paths):
        if (p / "metrics.jsonl").is_file():
            out.append(p)
        elif p.is_dir() and (children := sorted(c for c in p.iterdir() if (c / "metrics.jsonl").is_file())):
            out.extend(children)
        else:
            raise FileNotFoundError(f"{p}: no metrics.jsonl here or in its subdirectories; pass run directories "
                                    "(the trainer's trainer.output_dir) or a sweep directory")
    return out


def run(args: argparse.Namespace) -> int:
    from mcpo_megatron.report.build import ReportOptions, build_report

    for bad, msg in ((args.warmup_steps < 0, f"--warmup-steps={args.warmup_steps}: must be >= 0"),
                     (args.last_steps < 1, f"--last-steps={args.last_steps}: must be >= 1"),
                     (not 0 < args.confidence < 1, f"--confidence={args.confidence}: must be between 0 and 1, e.g. 0.95")):
        if bad:
            print(f"mcpo report: {msg}", file=sys.stderr)
            return 2
    try:
        dirs = expand_run_dirs(args.run_dirs)
        options = ReportOptions(title=args.title, note=args.note, warmup_steps=args.warmup_steps,
                                last_steps=args.last_steps, confidence=args.confidence, reference=args.reference)
        path = build_report(dirs, args.out, options)
    except (FileNotFoundError, ValueError) as e:
        print(f"mcpo report: {e}", file=sys.stderr)
        return 1
    print(f"wrote {path} ({len(dirs)} runs)")
    return 0

