"""Benchmark: MCPO loss (PG + hinge-KL, MCPO advantages) vs the DAPO loss (PG only) on the same tensors, on CPU.

Times forward + backward of ``policy_loss`` (with its metric sums) for a padded [B, T] batch, median of several
repeats, both arms interleaved in one run, and prints a table with the MCPO / DAPO time ratio (goal <= 1.10).
The headline is process CPU time (robust when other jobs share the machine); wall-clock medians are printed too.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from machine import describe

from mcpo_megatron.algorithms import (
    group_advantages,
    local_counts,
    policy_loss,
    sequence_mastered,
    token_weights,
)

GOAL = 1.10


def make_batch(tokens: int, seqs: int, group_size: int, mastered_frac: float, seed: int):
    """Random response lengths summing to ``tokens``; ``mastered_frac`` of the groups all correct; drift ~ 0.02."""
    g = torch.Generator().manual_seed(seed)
    num_groups = seqs // group_size
    mean_len = tokens // seqs
    lens = torch.randint(mean_len // 2, mean_len * 3 // 2 + 1, (seqs,), generator=g)
    lens = (lens * tokens // int(lens.sum())).clamp(min=1)
    lens[: tokens - int(lens.sum())] += 1  # exact token count
    assert int(lens.sum()) == tokens
    T = int(lens.max())
    mask = torch.arange(T)[None, :] < lens[:, None]
    n_mastered = round(mastered_frac * num_groups)
    correct = (torch.rand(seqs, generator=g) < 0.5).float()
    correct[: n_mastered * group_size] = 1.0
    rewards = correct.clone()
    mastered = sequence_mastered(correct, group_size)
    adv_mcpo = group_advantages(rewards, correct, group_size, estimator="mcpo")
    adv_dapo = group_advantages(rewards, correct, group_size, estimator="grpo")
    old = -torch.rand(seqs, T, generator=g) * 3
    logp = old + 0.02 * torch.randn(seqs, T, generator=g)
    counts = local_counts(mask, mastered)
    pg_w, hk_w = token_weights(mask, mastered, loss_agg_mode="seq-mean-token-mean", global_tokens=counts[0],
                               global_seqs=counts[1], global_mastered=counts[2])
    return dict(mask=mask, old=old, logp=logp, adv_mcpo=adv_mcpo.float(), adv_dapo=adv_dapo.float(),
                pg_w=pg_w, hk_w=hk_w, T=T)


def run_once(b, arm: str) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of one forward + backward."""
    logp = b["logp"].clone().requires_grad_(True)
    c0, t0 = time.process_time(), time.perf_counter()
    if arm == "mcpo":
        loss, _ = policy_loss(logp, b["old"], b["adv_mcpo"], b["pg_w"], b["mask"], hkl_weight=b["hk_w"])
    else:
        loss, _ = policy_loss(logp, b["old"], b["adv_dapo"], b["pg_w"], b["mask"])
    loss.backward()
    return time.process_time() - c0, time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=65536, help="valid response tokens in the batch (65536)")
    ap.add_argument("--seqs", type=int, default=512, help="sequences in the batch (512)")
    ap.add_argument("--group-size", type=int, default=16, help="responses per prompt (16)")
    ap.add_argument("--mastered-frac", type=float, nargs="+", default=[0.5],
                    help="fraction of mastered groups, one table row each (0.5)")
    ap.add_argument("--repeats", type=int, default=50, help="timed repeats per arm; the median is reported (50)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed repeats per arm first (5)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.seqs % args.group_size:
        ap.error(f"--seqs={args.seqs} must be a multiple of --group-size={args.group_size}")

    print(f"policy_loss forward+backward on CPU, float32, {args.tokens} tokens / {args.seqs} sequences, "
          f"G={args.group_size}, threads={torch.get_num_threads()}, median of {args.repeats}")
    print(describe())
    header = (f"{'mastered':>9} {'pad T':>6} {'DAPO cpu':>9} {'MCPO cpu':>9} {'ratio':>7} "
              f"{'DAPO min':>9} {'MCPO min':>9} {'ratio':>7} {'DAPO wall':>10} {'MCPO wall':>10} {'ratio':>7} "
              f"{'goal':>5}")
    print(header)
    print("-" * len(header))
    worst = 0.0
    for frac in args.mastered_frac:
        b = make_batch(args.tokens, args.seqs, args.group_size, frac, args.seed)
        for _ in range(args.warmup):
            run_once(b, "dapo")
            run_once(b, "mcpo")
        t = {"dapo": [], "mcpo": []}
        for _ in range(args.repeats):  # interleaved so drifts in machine load hit both arms alike
            t["dapo"].append(run_once(b, "dapo"))
            t["mcpo"].append(run_once(b, "mcpo"))
        med = {arm: [statistics.median(x[i] for x in t[arm]) for i in (0, 1)] for arm in t}
        low = {arm: min(x[0] for x in t[arm]) for arm in t}
        ratio = med["mcpo"][0] / med["dapo"][0]
        worst = max(worst, ratio)
        print(f"{frac:>9.2f} {b['T']:>6d} {med['dapo'][0] * 1e3:>9.3f} {med['mcpo'][0] * 1e3:>9.3f} {ratio:>7.3f} "
              f"{low['dapo'] * 1e3:>9.3f} {low['mcpo'] * 1e3:>9.3f} {low['mcpo'] / low['dapo']:>7.3f} "
              f"{med['dapo'][1] * 1e3:>10.3f} {med['mcpo'][1] * 1e3:>10.3f} {med['mcpo'][1] / med['dapo'][1]:>7.3f} "
              f"{GOAL:>5.2f}")
    print("ms per forward + backward: cpu = median process CPU time, min = its minimum, wall = median wall clock; "
          "ratio = MCPO / DAPO")
    print(f"worst median CPU-time ratio {worst:.3f} ({'meets' if worst <= GOAL else 'misses'} the goal <= {GOAL})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
