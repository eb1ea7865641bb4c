"""The embedded default job: SmolLM2-135M-Instruct learns small arithmetic with MCPO, next to DAPO.

``mcpo demo`` (``make demo``) trains the CPU default config twice with the same seed and
the same prompts, once with MCPO and once with the DAPO baseline without dynamic sampling (no reweighting, no hinge-KL), each under
torchrun with 2 processes (TP=2), then writes the accuracy curves and the mastered fraction to a PNG and
prints the first/last-step accuracy of both runs.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = REPO / "configs" / "cpu_smollm2_arith.yaml"
ARMS = {
    "mcpo": [],
    # DAPO without dynamic sampling: both arms then train on the same prompts and differ only by MCPO's parts.
    "dapo": ["algorithm.name=dapo", "algorithm.filter_groups.enable=false"],
}


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("demo", help="the embedded default job: MCPO vs DAPO on CPU, curves and a table",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="training config (default: the CPU demo)")
    p.add_argument("--arms", default="mcpo,dapo", help="comma-separated arms to run: mcpo, dapo")
    p.add_argument("--nproc", type=int, default=2, help="processes per run (torchrun)")
    p.add_argument("--out", default="runs/demo", help="directory for the runs (one sub-directory per arm)")
    p.add_argument("--plot", default="docs/demo_curves.png", help="where to write the curves PNG")
    p.add_argument("overrides", nargs="*", help="key=value overrides applied to every arm")
    return p


def run_arm(name: str, args) -> float:
    from mcpo_megatron.parallel.distributed import run_under_torchrun

    out_dir = Path(args.out) / name
    print(f"\n=== {name}", flush=True)
    t0 = time.time()
    # A demo run always starts fresh; an earlier one in the same directory is moved aside, not deleted.
    rc = run_under_torchrun(["train", args.config, f"trainer.output_dir={out_dir}", "trainer.resume=never",
                             "trainer.overwrite=true", *ARMS[name], *args.overrides], args.nproc)
    if rc != 0:
        raise SystemExit(f"error: the {name} run failed (exit code {rc}); its log is above")
    return time.time() - t0


def plot(runs: dict[str, list[dict]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for name, recs in runs.items():
        steps = [r["step"] for r in recs]
        axes[0].plot(steps, [r["acc/mean"] for r in recs], marker="o", label=name.upper())
        axes[1].plot(steps, [r["mastery/mastered_frac"] for r in recs], marker="o", label=name.upper())
    axes[0].set(title="training accuracy (mean over rollouts)", xlabel="step", ylabel="accuracy")
    axes[1].set(title="mastered prompts (all rollouts correct)", xlabel="step", ylabel="fraction of groups")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("SmolLM2-135M-Instruct, CPU, TP=2: MCPO vs DAPO (same seed, same prompts)")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def run(args) -> int:
    from mcpo_megatron.accounting import read_jsonl

    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        print(f"error: --arms {args.arms}: unknown arm(s) {unknown}; choose from {sorted(ARMS)}", file=sys.stderr)
        return 2
    walls, runs = {}, {}
    for arm in arms:
        walls[arm] = run_arm(arm, args)
        runs[arm] = read_jsonl(Path(args.out) / arm / "metrics.jsonl")
    plot(runs, args.plot)
    print("\n| arm | steps | acc first step | acc last step | acc last 3 steps | mastered last step | wall s |")
    print("|---|---|---|---|---|---|---|")
    for arm, recs in runs.items():
        last3 = [r["acc/mean"] for r in recs[-3:]]
        print(f"| {arm.upper()} | {len(recs)} | {recs[0]['acc/mean']:.3f} | {recs[-1]['acc/mean']:.3f} | "
              f"{sum(last3) / len(last3):.3f} | {recs[-1]['mastery/mastered_frac']:.3f} | {walls[arm]:.0f} |")
    print(f"\ncurves: {args.plot}")
    return 0

