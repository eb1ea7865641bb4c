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
  trainer.max_staleness=2 (a carried reply trains two versions after its first token), and in-flight weight
  updates (the engine takes the version the trainer publishes in the middle of a batch: repeatable mode, the
  default); ``separate-partial-fast`` with them in the fast mode, ``separate-partial-between`` without them
  (versions taken between batches only);
* ``colocated-partial``: colocated with rollout.partial, trainer.max_staleness=1.

Every configuration runs ``--repeats`` times, the configurations in turn, and the table shows each one's fastest run
(on a machine shared with other jobs they only ever slow a run down). Rows are means over the steps after the
first two (start-up, and the partial configurations' pool filling).
``tokens/s`` is the response tokens trained per second of step; ``engine idle`` the share of a step the engines do
not generate (colocated: the part of the step that is not generation, when the engine sleeps); ``generation``
the engines' generation time per step, ``training`` the trainer's time besides waiting for rollouts. The last
column (separate placement): the steps' time over the longer, step by step, of the two phases that overlap in it
(the previous step's training and the generation of the step's own batch, which ran meanwhile), summed (1.00: one
phase entirely hidden behind the other; the goal for separate-partial is <= 1.05; as it was, separate placement
submitted the next batch before a step's own was back, so a batch's generation also ran before the previous step
and the ratio can fall below 1).

    python bench/bench_partial.py                       # about 15 minutes on a 2-core machine
    python bench/bench_partial.py --configs separate-partial --steps 3 --max-new-tokens 16   # a smoke run
    python bench/bench_partial.py --scaling-model      # the model of the gain at the 14B recipe (docs/scaling.md)
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from machine import describe  # noqa: E402
from train_runs import train_metrics  # noqa: E402

# name: (row label, overrides)
CONFIGS = {
    "colocated": ("colocated", []),
    "separate": ("separate (max_staleness 1)", ["rollout.placement=separate", "rollout.ranks=1",
                                                "trainer.max_staleness=1"]),
    "separate-partial": ("separate, partial + in-flight (max_staleness 2)",
                         ["rollout.placement=separate", "rollout.ranks=1", "trainer.max_staleness=2",
                          "rollout.partial.enable=true"]),
    "separate-partial-fast": ("separate, partial + in-flight, fast mode",
                              ["rollout.placement=separate", "rollout.ranks=1", "trainer.max_staleness=2",
                               "rollout.partial.enable=true", "rollout.partial.inflight_updates=fast"]),
    "separate-partial-between": ("separate, partial, versions between batches",
                                 ["rollout.placement=separate", "rollout.ranks=1", "trainer.max_staleness=2",
                                  "rollout.partial.enable=true", "rollout.partial.inflight_updates=off"]),
    "colocated-partial": ("colocated, partial (max_staleness 1)", ["trainer.max_staleness=1",
                                                                   "rollout.partial.enable=true"]),
}
SEPARATE = ("separate", "separate-partial", "separate-partial-fast", "separate-partial-between")
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
    p.add_argument("--repeats", type=int, default=2, help="runs of every configuration, in turn; the table shows "
                   "each configuration's fastest (other jobs on the machine only ever slow a run down)")
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


def run(name: str, args, shared: list[str], repeat: int = 0) -> list[dict]:
    label, extra = CONFIGS[name]
    out = Path(args.out) / (name if repeat == 0 else f"{name}.{repeat}")
    return train_metrics(label, [*shared, *extra, *args.overrides, f"trainer.total_steps={args.steps}"], out)


def summarize(every: list[dict], separate: bool) -> dict:
    """Means over the steps after WARMUP; with separate placement the overlap: a step's time over the longer of the
    previous step's training and its own batch's generation, which ran during that training (submitted when the
    previous step took its batch), summed over the counted steps after the first."""
    records = every[WARMUP:]

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
    row["bound"] = None
    pairs = list(zip(every[WARMUP:], every[WARMUP + 1:]))
    if separate and pairs:
        row["bound"] = (sum(nxt["time/step"] for _, nxt in pairs) / sum(
            max(r["time/step"] - r["time/rollout"], nxt["time/engine_generate"]) for r, nxt in pairs))
    return row


# ------------------------------------------------------------------------------------------ the scaling model
# One rollout replica of the Qwen3-14B recipe (rollout TP 4 on 4 H100s; docs/scaling.md, "Generation with offload"):
# a decode step reads the replica's weights once and every running sequence's KV cache, at 70% of 3.35 TB/s.
REPLICA = dict(weights_bytes=6.9 * 2**30, kv_bytes_per_token=40 * 2**10, bandwidth=0.7 * 3.35e12,
               kv_capacity_tokens=1_781_000, prefill_s_per_token=2 * 14.8e9 / (4 * 989e12 * 0.5))


def sample_lengths(rng, groups: int, n: int, cap: int, hard_frac: float, mean_range: tuple[float, float]):
    """Response lengths of ``groups`` prompts x ``n``: a ``hard_frac`` share of prompts is hard (every response at
    the cap), the others draw a mean uniformly from ``mean_range`` and exponential lengths around it (capped)."""
    import numpy as np

    hard = rng.random(groups) < hard_frac
    means = rng.uniform(*mean_range, size=groups)
    lengths = np.minimum(np.ceil(rng.exponential(means[:, None], size=(groups, n))), cap)
    lengths[hard] = cap
    return lengths.astype(np.int64)


@dataclasses.dataclass(frozen=True)
class ReplicaWorkload:
    """What one replica generates each step: ``groups`` prompts (a quarter of the recipe's 128) of ``n`` responses
    each, ``spare`` more groups in the pool with partial rollouts, ``prompt`` tokens each, lengths as
    :func:`sample_lengths` draws them (``hard_frac``, ``mean_range``) up to ``cap``."""

    groups: int = 32
    spare: int = 16
    n: int = 16
    cap: int = 20480
    prompt: int = 512
    hard_frac: float = 0.1
    mean_range: tuple[float, float] = (1000.0, 8000.0)


def simulate_replica(partial: bool, work: ReplicaWorkload, *, carry: int = 1, steps: int = 24, warmup: int = 6,
                     segment: int = 64, seed: int = 0) -> dict:
    """Seconds of decoding per step on one replica for ``work``, whole batches or partial rollouts (a response
    may be carried ``carry`` steps: max_staleness less the placement's version of pipelining,
    staleness_policy=wait), at ``segment``-token granularity, over ``steps`` steps of which ``warmup`` are not
    counted.

    The replica decodes the batch's sequences in arrival order as far as their KV cache fits its capacity (vLLM's
    continuous batching; the others wait, and the recompute of a preempted sequence is not counted); a segment costs
    its decode steps (the weights plus the running sequences' KV cache read per step), and a batch the prefill of
    every sequence it starts (a carried response: its prompt and tokens so far again). A partial batch ends as
    trainer/partial_schedule.py ends it: ``groups`` complete, the due ones among them, and at least
    cap / (carry + 1) decoding steps run."""
    import numpy as np

    rp = REPLICA
    groups, spare, n, cap, prompt = work.groups, work.spare, work.n, work.cap, work.prompt
    t_weights, t_kv = rp["weights_bytes"] / rp["bandwidth"], rp["kv_bytes_per_token"] / rp["bandwidth"]
    rng = np.random.default_rng(seed)
    pool: list[dict] = []  # per group: target lengths, tokens so far, the step it was drawn
    times, tokens = [], []
    for step in range(steps):
        fresh = groups + spare - len(pool) if partial else groups
        for target in sample_lengths(rng, fresh, n, cap, work.hard_frac, work.mean_range):
            pool.append({"target": target, "done": np.zeros(n, dtype=np.int64), "first": step})
        batch = list(pool) if partial else pool[:groups]

        def complete(g):
            return bool((g["done"] >= g["target"]).all())

        def due(g):
            return step - g["first"] >= carry

        seqs = [(g, j) for g in batch for j in range(n) if g["done"][j] < g["target"][j]]
        elapsed = sum(prompt + int(g["done"][j]) for g, j in seqs) * rp["prefill_s_per_token"]
        decoded = 0
        while True:
            done = [g for g in batch if complete(g)]
            if len(done) == len(batch) or (partial and len(done) >= groups and decoded >= cap / (carry + 1)
                                           and all(complete(g) for g in batch if due(g))):
                break
            running, ctx = [], 0
            for g, j in seqs:
                if g["done"][j] >= g["target"][j]:
                    continue
                need = prompt + int(g["done"][j]) + segment
                if running and ctx + need > rp["kv_capacity_tokens"]:
                    break
                running.append((g, j))
                ctx += need - segment // 2  # the mean context over the segment
            elapsed += segment * (t_weights + t_kv * ctx)
            decoded += segment
            for g, j in running:
                g["done"][j] = min(int(g["done"][j]) + segment, int(g["target"][j]))
        take = sorted((g for g in batch if complete(g)), key=lambda g: (not due(g), g["first"]))[:groups]
        pool = [g for g in pool if not any(g is t for t in take)]
        if step >= warmup:
            times.append(elapsed)
            tokens.append(sum(int(g["target"].sum()) for g in take))
    return {"seconds": float(np.mean(times)), "tokens": float(np.mean(tokens))}


# (replicas for the step's 128 prompts, hard share, other prompts' mean lengths, carry)
SCALING_CASES = ((4, 0.10, (1000.0, 8000.0), 1), (4, 0.02, (1000.0, 4000.0), 1), (4, 0.02, (1000.0, 4000.0), 3),
                 (8, 0.02, (1000.0, 4000.0), 1), (16, 0.02, (1000.0, 4000.0), 1), (16, 0.10, (1000.0, 8000.0), 1))


def scaling_rows() -> list[dict]:
    rows = []
    for replicas, hard_frac, mean_range, carry in SCALING_CASES:
        groups = 128 // replicas
        work = ReplicaWorkload(groups=groups, spare=groups // 2, hard_frac=hard_frac, mean_range=mean_range)
        whole = simulate_replica(False, work)
        part = simulate_replica(True, work, carry=carry)
        rows.append({"replicas": replicas, "hard": hard_frac, "means": mean_range, "carry": carry,
                     "whole_s": whole["seconds"], "partial_s": part["seconds"], "tokens": whole["tokens"],
                     "gain": (part["tokens"] / part["seconds"]) / (whole["tokens"] / whole["seconds"])})
    return rows


def print_scaling_model() -> None:
    print("| replicas (prompts each) | hard prompts | others' mean length | carry | tokens / step / replica | "
          "decoding s, whole batches | decoding s, partial | tokens/s gain |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|")
    for r in scaling_rows():
        print(f"| {r['replicas']} ({128 // r['replicas']}) | {r['hard']:.2f} | {r['means'][0]:,.0f}-{r['means'][1]:,.0f} "
              f"| {r['carry']} | {r['tokens']:,.0f} | {r['whole_s']:,.0f} | {r['partial_s']:,.0f} | {r['gain']:.2f}x |")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.scaling_model:
        print_scaling_model()
        return 0
    Path(args.out).mkdir(parents=True, exist_ok=True)
    shared = workload(args)
    rows: dict[str, dict] = {}
    for repeat in range(args.repeats):
        for name in args.configs:
            row = summarize(run(name, args, shared, repeat), separate=name in SEPARATE)
            if name not in rows or row["step"] < rows[name]["step"]:
                rows[name] = row
    print(f"\nworkload long-tail-cpu (the fastest of {args.repeats} runs each, configurations in turn; "
          f"{args.steps - WARMUP} steps counted per run: {args.batch} prompts x "
          f"{args.n} replies, cap {args.max_new_tokens} tokens, {args.long_frac:.0%} of prompts long, short replies "
          f"ending with probability {args.short_stop} per token, {args.layers} layers; partial: {args.spare} spare "
          f"groups, segments of {args.segment}), {describe()}")
    print("| configuration | step s | tokens/step | tokens/s | engine idle | generation s | training s | token lag | "
          "step / max(gen, train) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        bound = "-" if r["bound"] is None else f"{r['bound']:.2f}"
        print(f"| {CONFIGS[name][0]} | {r['step']:.2f} | {r['tokens']:.0f} | {r['tokens_per_s']:.0f} | "
              f"{r['idle']:.2f} | {r['generation']:.2f} | {r['training']:.2f} | {r['lag']:.2f} | {bound} |")
    if "separate" in rows and "separate-partial" in rows:
        gain = rows["separate-partial"]["tokens_per_s"] / rows["separate"]["tokens_per_s"]
        print(f"\nseparate, partial / separate: {gain:.2f}x tokens trained per second (goal >= 1.3x); its step / "
              f"max(generation, training) = {rows['separate-partial']['bound']:.2f} (goal <= 1.05)")
    else:
        print("\ngain: not measured (needs --configs separate separate-partial)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
