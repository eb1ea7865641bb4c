"""Benchmark: reward throughput of MathVerifyScorer on realistic chain-of-thought responses.

Generates N responses (multi-line reasoning, then an ``Answer:`` line; a mix of correct and
incorrect integers, fractions, decimals and boxed answers, 0.5-4k characters), scores them with
the worker pool, then scores the same set with a fraction of adversarial items mixed in
(exponent towers, hanging symbolic expansions, huge responses, garbage). Prints a table with
items/s for both runs (goals: >= 200/s clean and >= 50/s with 1% adversarial on 2 cores), the
worst wall time of a single item, and the reward status counts. The labels of the generated
responses are known by construction, so the table also reports the accuracy of the scorer.
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import sys
import time
from fractions import Fraction

import psutil
from machine import describe

from mcpo_megatron.rewards import MathVerifyScorer, status_counts

CLEAN_GOAL = 200.0
ADVERSARIAL_GOAL = 50.0

ADVERSARIAL = [
    "So the answer is \\boxed{9^{9^{9^9}}}",
    "Answer: $5^{5^{5^5}}$",
    "\\boxed{(x+1)^{3000}}",  # hangs in sympy: killed at the deadline
    "\\boxed{\\sin(x)^{300}+\\cos(x)^{300}}",  # hangs in simplify: killed at the deadline
    "Answer: " + "(" * 3000 + "1" + ")" * 3000,
    "x" * 100_000 + "\nAnswer: 8",
    "Answer: " + "\\frac{1}{" * 2000,
    bytes(range(256)).decode("latin-1") * 400,
    "",
    "\\boxed{\\prod_{k=1}^{10^{8}} k}",
]

STEPS = [
    "First, note that {a} + {b} = {s}.",
    "Multiplying both sides by {b} gives {p}.",
    "We can check this: {a} \\cdot {b} = {p}, which matches.",
    "Let $x = {a}$. Then $x^2 = {sq}$ and $2x = {d}$.",
    "Subtracting, {s} - {b} = {a}, as expected.",
    "The fraction simplifies to $\\frac{{{a}}}{{{b}}}$.",
    "Hmm, wait. Let me reconsider the case where $x > {a}$.",
    "By the triangle inequality, the sum is at most {s}.",
]


def make_response(rng: random.Random) -> tuple[str, str, int]:
    """(response, gold, expected correct) of one synthetic chain of thought."""
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    fmt = dict(a=a, b=b, s=a + b, p=a * b, sq=a * a, d=2 * a)
    lines = [rng.choice(STEPS).format(**fmt) for _ in range(rng.randint(8, 60))]
    kind = rng.choice(["int", "int", "int", "fraction", "decimal", "boxed"])
    correct = rng.random() < 0.5
    if kind == "int":
        gold = str(a * b)
        ans = gold if correct else str(a * b + rng.choice([-1, 1, 10]))
        tail = f"Answer: {ans}"
    elif kind == "fraction":
        q = Fraction(a, b)
        gold = f"\\frac{{{q.numerator}}}{{{q.denominator}}}"
        ans = q if correct else q + 1
        tail = f"Answer: {ans.numerator}/{ans.denominator}" if rng.random() < 0.5 else \
            f"Answer: \\frac{{{ans.numerator}}}{{{ans.denominator}}}"
    elif kind == "decimal":
        gold = f"{a}.5"
        tail = f"Answer: {a}.5" if correct else f"Answer: {a}.25"
    else:
        gold = str(a + b)
        tail = f"Therefore the answer is $\\boxed{{{a + b if correct else a + b + 2}}}$."
    return "\n".join(lines) + "\n\n" + tail, gold, int(correct)


def make_set(n: int, adversarial_frac: float, seed: int):
    rng = random.Random(seed)
    items = [make_response(rng) for _ in range(n)]
    n_adv = round(n * adversarial_frac)
    for j, pos in enumerate(sorted(rng.sample(range(n), n_adv))):
        items[pos] = (ADVERSARIAL[j % len(ADVERSARIAL)], "1", 0)
    return items


def _live_worker_cpu(scorer: MathVerifyScorer) -> dict[int, float]:
    out = {}
    procs = [w.proc for w in scorer._workers] + ([scorer._spare.proc] if scorer._spare is not None else [])
    for p in procs:
        try:
            t = psutil.Process(p.pid).cpu_times()
            out[p.pid] = t.user + t.system
        except psutil.Error:
            pass
    return out


def _reaped_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run(scorer: MathVerifyScorer, items) -> dict:
    """Score ``items`` once; wall-clock rate plus the CPU seconds the parent and workers spent.

    On a shared machine the wall-clock rate depends on other load; ``cpu_rate`` = items per
    (core seconds / workers) estimates what ``workers`` dedicated cores would sustain.
    """
    scorer.max_item_seconds = 0.0
    live0, reaped0, parent0 = _live_worker_cpu(scorer), _reaped_cpu(), time.process_time()
    t0 = time.perf_counter()
    results = scorer.score([r for r, _, _ in items], [g for _, g, _ in items])
    wall = time.perf_counter() - t0
    live1 = _live_worker_cpu(scorer)
    cpu = (time.process_time() - parent0) + (_reaped_cpu() - reaped0)
    cpu += sum(t - live0.get(pid, 0.0) for pid, t in live1.items())
    # On dedicated cores a killed item holds its core for the whole deadline; on a loaded machine it
    # got only part of a core, so charge the full deadline on top (a conservative estimate).
    kills = sum(r.status in ("timeout", "crashed") for r in results)
    core_s = cpu + kills * scorer.timeout_s
    cpu_rate = len(items) / (core_s / scorer.num_workers)
    agree = sum(int(res.correct == want) for res, (_, _, want) in zip(results, items)) / len(items)
    return {"items": len(items), "seconds": wall, "items_per_s": len(items) / wall, "cpu_s": cpu,
            "core_s": core_s, "cpu_rate": cpu_rate, "agree": agree,
            "worst_item_s": scorer.max_item_seconds, "status": status_counts(results)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num", type=int, default=2000, help="responses per run (default 2000)")
    ap.add_argument("--workers", type=int, default=2, help="reward worker processes (default 2)")
    ap.add_argument("--timeout", type=float, default=10.0, help="per-item deadline in seconds (default 10)")
    ap.add_argument("--memory-mb", type=int, default=2048, help="RLIMIT_AS per worker (default 2048)")
    ap.add_argument("--adversarial", type=float, default=0.01, help="adversarial fraction of run 2 (default 0.01)")
    ap.add_argument("--chunk-size", type=int, default=16, help="items per worker round trip (default 16)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    clean = make_set(args.num, 0.0, args.seed)
    mixed = make_set(args.num, args.adversarial, args.seed)
    with MathVerifyScorer(args.workers, args.timeout, args.memory_mb, chunk_size=args.chunk_size) as scorer:
        scorer.wait_ready()
        scorer.score([r for r, _, _ in clean[:20]], [g for _, g, _ in clean[:20]])  # warm caches
        rows = [("clean", CLEAN_GOAL, run(scorer, clean)),
                (f"{args.adversarial:.0%} adversarial", ADVERSARIAL_GOAL, run(scorer, mixed))]
        respawns = scorer.counters["respawns"]

    load = os.getloadavg()[0]
    print(f"reward throughput: {args.num} chain-of-thought responses, {args.workers} workers, "
          f"timeout {args.timeout:g} s, chunk {args.chunk_size}; load average {load:.1f}")
    print()
    print(describe())
    print("| run | items | wall s | items/s (wall) | core s | items/s on dedicated cores | goal | ok? (CPU) "
          "| worst item s | label agreement | statuses |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    ok_all = True
    for name, goal, r in rows:
        ok = r["cpu_rate"] >= goal
        ok_all &= ok
        st = ", ".join(f"{k}={v}" for k, v in r["status"].items())
        print(f"| {name} | {r['items']} | {r['seconds']:.2f} | {r['items_per_s']:.0f} | {r['core_s']:.1f} | "
              f"{r['cpu_rate']:.0f} | >= {goal:.0f} | {'yes' if ok else 'NO'} | {r['worst_item_s']:.2f} | "
              f"{r['agree']:.4f} | {st} |")
    print()
    print(f"worker respawns: {respawns}. 'items/s (wall)' is what this machine gave under its current load; "
          "'on dedicated cores' divides the items by the core seconds per worker: CPU seconds "
          "spent (parent + workers, killed ones included) plus the full deadline of every killed item.")
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
