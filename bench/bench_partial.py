"""Partial rollouts on CPU: tokens trained per second and the engines' idle share on a long-tailed length workload,
for colocated engines and separate placement as they were, and both with partial rollouts, run one after the other
on the same machine.

Workload ("long-tail-cpu"): a tiny model whose reply lengths are set by the prompt (models/tiny.
make_long_tail_model: a Markov chain of digits; after a prompt ending in "S" each token ends the reply with
probability ``--short-stop``, after one ending in "L" no token does, so those replies run to the cap), on prompts
of which ``--long-frac`` end in "L": most replies are short and a tail sits at the maximum, the shape of the
paper's lengths (most responses far below 20,480 tokens, a few at it). A step trains ``--batch`` prompts x
``--n`` replies (2 optimizer steps); the PyTorch engine decodes every running reply of a batch together. Two
processes, one thread each, in every configuration:

* ``colocated``: both ranks train (DP=2) and each generates half of every batch, in turn (the default placement);
* ``separate``: rank 0 trains, rank 1 generates, trainer.max_staleness=1 (the next step's batch is generated
  while a step trains) - the separate placement as it was;
* ``separate-partial``: the same ranks with rollout.partial (spare groups, a batch ends once ``--batch`` groups
  are complete, checked every ``--segment`` decoding steps; unfinished replies continue in the next batch),
  trainer.max_staleness=2 (a carried reply trains two versions after its first token);
* ``colocated-partial``: colocated with rollout.partial, trainer.max_staleness=1.

Rows are means over the steps after the first two (start-up, and the partial configurations' pool filling).
``tokens/s`` is the response tokens trained per second of step; ``engine idle`` the share of a step the engines do
not generate (colocated: the part of the step that is not generation, when the engine sleeps); ``generation``
the engines' generation time per step, ``training`` the trainer's time besides waiting for rollouts. The last
column: a step over max(generation, training) (1.00: one phase entirely hidden behind the other; the goal for
separate-partial is <= 1.05).

    python bench/bench_partial.py                       # about 10 minutes on a 2-core machine
    python bench/bench_partial.py --configs separate-partial --steps 3 --max-new-tokens 16   # a smoke run
    python bench/bench_partial.py --scaling-model      # the model of the gain at the 14B recipe (docs/scaling.md)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from machine import describe  # noqa: E402

# name: (row label, overrides)
CONFIGS = {
    "colocated": ("colocated", []),
    "separate": ("separate (max_staleness 1)", ["rollout.placement=separate", "rollout.ranks=1",
                                                "trainer.max_staleness=1"]),
    "separate-partial": ("separate, partial (max_staleness 2)",
                         ["rollout.placement=separate", "rollout.ranks=1", "trainer.max_staleness=2",
                          "rollout.partial.enable=true"]),
    "colocated-partial": ("colocated, partial (max_staleness 1)", ["trainer.max_staleness=1",
                                                                   "rollout.partial.enable=true"]),
}
SEPARATE = ("separate", "separate-partial")
WARMUP = 2  # steps not counted


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=10, help=f"global steps per configuration (the first {WARMUP} are "
                   "not counted)")
    p.add_argument("--batch", type=int, default=8, help="prompts per step (data.train_batch_size)")
    p.add_argument("--n", type=int, default=4, help="replies per prompt (rollout.n)")
    p.add_argument("--max-new-tokens", type=int, default=384, help="the reply cap")
    p.add_argument("--long-frac", type=float, default=0.25, help="share of prompts whose replies run to the cap")
    p.add_argument("--short-stop", type=float, default=0.1, help="per-token end probability of a short reply")
    p.add_argument("--spare", type=int, default=4, help="rollout.partial.spare_groups")
    p.add_argument("--segment", type=int, default=16, help="rollout.partial.segment_tokens")
    p.add_argument("--layers", type=int, default=4, help="layers of the model")
    p.add_argument("--out", default=str(REPO / "runs" / "bench_partial"), help="run directories")
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    p.add_argument("--scaling-model", action="store_true", help="print the model of the gain at the Qwen3-14B "
                   "recipe's 20,480-token responses (docs/scaling.md) and exit")
    p.add_argument("overrides", nargs="*", help="key=value overrides for every configuration")
    args = p.parse_args(argv)
    if not args.scaling_model and args.steps <= WARMUP:
        p.error(f"--steps={args.steps} must be > {WARMUP}: the first {WARMUP} steps are not counted")
    return args


def workload(args) -> list[str]:
    """The model and prompts (written under --out once) and the overrides every configuration shares."""
    from mcpo_megatron.models.tiny import make_long_tail_model, write_length_prompts

    out = Path(args.out)
    tag = f"L{args.layers}-s{args.short_stop}"
    model, prompts = out / f"model-{tag}", out / f"prompts-{args.long_frac}.jsonl"
    if not (model / "config.json").is_file():
        make_long_tail_model(model, short_stop=args.short_stop, num_hidden_layers=args.layers)
    if not prompts.is_file():
        write_length_prompts(prompts, 400, long_frac=args.long_frac)
    cap = args.max_new_tokens
    return [f"model.path={model}", "model.dtype=fp32", f"rollout.n={args.n}", f"rollout.max_new_tokens={cap}",
            f"rollout.generation_batch_size={(args.batch + args.spare) * args.n}", "rollout.engine=torch",
            "data.train=jsonl", f"data.train_path={prompts}", "data.prompt_template=raw",
            "data.apply_chat_template=false", f"data.train_batch_size={args.batch}", "data.max_prompt_length=32",
            f"data.max_response_length={cap}", f"algorithm.mini_batch_size={max(1, args.batch // 2)}",
            "reward.answer_format=last_number", "reward.num_workers=1", "reward.overlong_buffer.enable=false",
            "optimizer.lr=1e-5", f"trainer.max_tokens_per_microbatch={8 * (32 + cap)}",
            "parallelism.tensor_model_parallel_size=1", "checkpoint.interval=0", "logging.tensorboard=false",
            f"rollout.partial.spare_groups={args.spare}", f"rollout.partial.segment_tokens={args.segment}"]


def run(name: str, args, shared: list[str]) -> list[dict]:
    label, extra = CONFIGS[name]
    out = Path(args.out) / name
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
           "mcpo_megatron.cli", "train", *shared, *extra, *args.overrides, f"trainer.total_steps={args.steps}",
           f"trainer.output_dir={out}", "trainer.resume=never", "trainer.overwrite=true"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    print(f"--- {label}: {' '.join(cmd[4:])}", flush=True)
    with open(f"{out}.log", "w") as log:
        rc = subprocess.call(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    if rc != 0:
        raise SystemExit(f"{label} failed (exit {rc}); see {out}.log")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][WARMUP:]


def summarize(records: list[dict], separate: bool) -> dict:
    def mean(fn):
        return sum(fn(r) for r in records) / len(records)

    gen_key = "time/engine_generate" if separate else "time/rollout"
    row = {"step": mean(lambda r: r["time/step"]), "generation": mean(lambda r: r[gen_key]),
           "training": mean(lambda r: r["time/step"] - r["time/rollout"]),
           "tokens": mean(lambda r: r["response/length_mean"] * r["batch/sequences"]),
           "length_max": max(r["response/length_max"] for r in records),
           "lag": mean(lambda r: r.get("partial/token_lag_mean", r["async/staleness_mean"]))}
    row["tokens_per_s"] = row["tokens"] / row["step"]
    row["idle"] = max(0.0, 1.0 - row["generation"] / row["step"])
    row["bound"] = row["step"] / max(row["generation"], row["training"])
    return row


# ------------------------------------------------------------------------------------------ the scaling model
def expected_max(lengths_cdf, n: int, cap: int, step: int = 1) -> float:
    """E[max of n i.i.d. lengths] from the CDF F(l) = P(L <= l) on 0..cap: sum over l of P(max > l)."""
    return sum(1.0 - lengths_cdf(l) ** n for l in range(0, cap, step)) * step


def scaling_model(cap: int = 20480, batch_groups: int = 128, n: int = 16, long_frac: float = 0.1,
                  short_mean: float = 6000.0, carry: int = 1) -> dict:
    """Decoding steps per generation batch at the Qwen3-14B recipe (128 prompts x 16 responses of up to 20,480
    tokens), without and with partial rollouts, in the memory-bound decoding regime (a step's time does not grow
    with the batch, as for a GPU decoding a few hundred sequences of a 14B model).

    Lengths: a ``long_frac`` share of prompts are hard (their responses run to the cap, as in the paper's tail),
    the others' responses are exponential with mean ``short_mean`` (capped). Without partial rollouts a batch lasts
    as long as its longest response: ``cap`` as soon as one prompt is hard (1 - (1 - long_frac)^128 ~ 1). With
    partial rollouts and ``carry`` steps of carry-over (max_staleness less the placement's one version of
    pipelining), a response spans up to carry + 1 batches, so in the steady state a batch lasts about the longer of
    cap / (carry + 1) (the due responses) and the time for the short groups to complete (E[max of 16]); every token
    is generated once either way, so tokens per decoding step grow by the ratio of the two batch lengths."""
    def short_cdf(length):
        return 1.0 - math.exp(-length / short_mean)

    short_group = expected_max(short_cdf, n, cap, step=16)
    whole = float(cap) if long_frac > 0 else short_group
    partial = max(cap / (carry + 1), short_group)
    return {"whole_batch_steps": whole, "partial_batch_steps": partial, "short_group_steps": short_group,
            "gain": whole / partial}


def print_scaling_model() -> None:
    print("| hard prompts | short mean (tokens) | carry | E[max of 16 short] | batch, whole | batch, partial | gain |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for long_frac, short_mean, carry in ((0.1, 4000.0, 1), (0.1, 6000.0, 1), (0.1, 6000.0, 2), (0.25, 6000.0, 1),
                                         (0.05, 3000.0, 1), (0.1, 8000.0, 1)):
        m = scaling_model(long_frac=long_frac, short_mean=short_mean, carry=carry)
        print(f"| {long_frac:.2f} | {short_mean:,.0f} | {carry} | {m['short_group_steps']:,.0f} | "
              f"{m['whole_batch_steps']:,.0f} | {m['partial_batch_steps']:,.0f} | {m['gain']:.2f}x |")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.scaling_model:
        print_scaling_model()
        return 0
    Path(args.out).mkdir(parents=True, exist_ok=True)
    shared = workload(args)
    rows = {name: summarize(run(name, args, shared), separate=name in SEPARATE) for name in args.configs}
    print(f"\nworkload long-tail-cpu ({args.steps - WARMUP} steps counted per configuration: {args.batch} prompts x "
          f"{args.n} replies, cap {args.max_new_tokens} tokens, {args.long_frac:.0%} of prompts long, short replies "
          f"ending with probability {args.short_stop} per token, {args.layers} layers; partial: {args.spare} spare "
          f"groups, segments of {args.segment}), {describe()}")
    print("| configuration | step s | tokens/step | tokens/s | engine idle | generation s | training s | token lag | "
          "step / max(gen, train) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        print(f"| {CONFIGS[name][0]} | {r['step']:.2f} | {r['tokens']:.0f} | {r['tokens_per_s']:.0f} | "
              f"{r['idle']:.2f} | {r['generation']:.2f} | {r['training']:.2f} | {r['lag']:.2f} | {r['bound']:.2f} |")
    if "separate" in rows and "separate-partial" in rows:
        gain = rows["separate-partial"]["tokens_per_s"] / rows["separate"]["tokens_per_s"]
        print(f"\nseparate, partial / separate: {gain:.2f}x tokens trained per second (goal >= 1.3x); its step / "
              f"max(generation, training) = {rows['separate-partial']['bound']:.2f} (goal <= 1.05)")
    else:
        print("\ngain: not measured (needs --configs separate separate-partial)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
