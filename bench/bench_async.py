"""Asynchronous RL on CPU: step time of synchronous colocated, separate placement at staleness 0, and separate
at staleness 1, run one after the other on the same machine, with the overlap achieved.

Workload ("async-cpu"): the demo model (SmolLM2-135M-Instruct, fp32) and prompts (one-digit arithmetic, 4
prompts x 8 samples a step, 2 optimizer steps), replies of up to 128 tokens (the demo's are 16), the PyTorch
engine decoding 4 sequences at a time (``rollout.generation_batch_size=4``): decoding is then bound by memory
traffic, as on GPUs, and a step's generation takes about as long as its training on one core each. Two
processes, one thread each, in every configuration:

* ``colocated``: both ranks train (DP=2) and each generates half the batch, in turn (the default placement);
* ``separate, staleness 0``: rank 0 trains, rank 1 generates; generation waits for the previous step's weights;
* ``separate, staleness 1``: the same ranks; the next step's batch is generated while this one trains.

Rows are means over the steps after the first (start-up and warm-up). ``generation`` is the engines' time
(``time/engine_generate``; colocated ``time/rollout``), ``training`` the trainer's time besides waiting for
rollouts (``time/step - time/rollout``). The overlap figure: staleness 1's step time over max(generation,
training) of the staleness-0 run (1.00 = the shorter phase entirely hidden; the goal is <= 1.15). Weight
transfer: the engines' receive rate over the bridge (gloo on CPU).

    python bench/bench_async.py            # about 25 minutes on a 2-core machine
    python bench/bench_async.py --configs staleness1 --steps 3 model.path=builtin:tiny-qwen3   # a smoke run
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from machine import describe  # noqa: E402
from train_runs import train_metrics  # noqa: E402

WORKLOAD = ["rollout.engine=torch", "rollout.generation_batch_size=4", "rollout.max_new_tokens=128",
            "data.max_response_length=128", "parallelism.tensor_model_parallel_size=1", "checkpoint.interval=0",
            "logging.tensorboard=false"]
# name on the command line: (row label, overrides)
CONFIGS = {
    "colocated": ("colocated", []),
    "staleness0": ("separate, staleness 0", ["rollout.placement=separate", "rollout.ranks=1"]),
    "staleness1": ("separate, staleness 1", ["rollout.placement=separate", "rollout.ranks=1",
                                             "trainer.max_staleness=1"]),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(REPO / "configs" / "cpu_smollm2_arith.yaml"))
    p.add_argument("--steps", type=int, default=5, help="global steps per configuration (the first is not counted)")
    p.add_argument("--out", default=str(REPO / "runs" / "bench_async"), help="run directories")
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS),
                   help="configurations to run (default: all; the overlap needs staleness0 and staleness1)")
    p.add_argument("overrides", nargs="*", help="key=value overrides for every configuration")
    args = p.parse_args(argv)
    if args.steps < 2:
        p.error(f"--steps={args.steps} must be >= 2: the first step is not counted")
    return args


def run(name: str, extra: list[str], args) -> list[dict]:
    out = Path(args.out) / name.replace(", ", "_").replace(" ", "_")
    train_args = [args.config, *WORKLOAD, *extra, *args.overrides, f"trainer.total_steps={args.steps}"]
    return train_metrics(name, train_args, out)[1:]


def summarize(records: list[dict], separate: bool) -> dict:
    def mean(fn):
        return sum(fn(r) for r in records) / len(records)

    gen_key = "time/engine_generate" if separate else "time/rollout"
    row = {"step": mean(lambda r: r["time/step"]), "generation": mean(lambda r: r[gen_key]),
           "training": mean(lambda r: r["time/step"] - r["time/rollout"]),
           "waiting": mean(lambda r: r["time/rollout"]),
           "staleness": mean(lambda r: r["async/staleness_mean"]),
           "tokens": mean(lambda r: r["response/length_mean"] * r["batch/sequences"])}
    updates = [r for r in records if r.get("async/weight_updates")]
    if updates:
        row["gbps"] = sum(r["async/weight_bytes"] for r in updates) / sum(r["reshard/transfer_s"] for r in updates) / 1e9
        row["bytes"] = updates[0]["async/weight_bytes"]
    return row


def print_overlap(rows: dict[str, dict]) -> None:
    """The overlap line: staleness 1's step against the longer phase of staleness 0 (and colocated's step)."""
    if "staleness0" not in rows or "staleness1" not in rows:
        print("\noverlap: not measured (needs --configs staleness0 staleness1)")
        return
    sync, overlap = rows["staleness0"], rows["staleness1"]
    bound = max(sync["generation"], sync["training"])
    colocated = (f"; colocated / staleness 1 = {rows['colocated']['step'] / overlap['step']:.2f}x"
                 if "colocated" in rows else "")
    print(f"\noverlap: staleness 1's step {overlap['step']:.1f} s / max(generation {sync['generation']:.1f} s, "
          f"training {sync['training']:.1f} s) of staleness 0 = {overlap['step'] / bound:.2f} (goal <= 1.15); "
          f"staleness 0 / staleness 1 = {sync['step'] / overlap['step']:.2f}x{colocated}")


def main(argv=None) -> int:
    args = parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    rows = {}
    for name in args.configs:
        label, extra = CONFIGS[name]
        rows[name] = summarize(run(label, extra, args), separate="rollout.placement=separate" in extra)
    print(f"\nworkload async-cpu ({args.steps - 1} steps counted per configuration), {describe()}")
    print("| configuration | step s | generation s | training s | trainer waits s | staleness | "
          "generated tokens/step | weights GB/s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        gbps = f"{r['gbps']:.2f} ({r['bytes'] / 1e6:.0f} MB)" if "gbps" in r else "-"
        print(f"| {CONFIGS[name][0]} | {r['step']:.1f} | {r['generation']:.1f} | {r['training']:.1f} | "
              f"{r['waiting']:.1f} | {r['staleness']:.2f} | {r['tokens']:.0f} | {gbps} |")
    print_overlap(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
