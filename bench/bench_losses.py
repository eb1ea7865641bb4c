"""Benchmark: MCPO loss (PG + hinge-KL, MCPO advantages) vs the DAPO loss (PG only) on the same tensors, on CPU.

Times forward + backward of ``policy_loss`` (with its metric sums) for a padded [B, T] batch, median of several
repeats, both arms interleaved in one run, and prints a table with the MCPO / DAPO time ratio (goal <= 1.10).
The headline is process CPU time (robust when other jobs share the machine); wall-clock medians are printed too.

``--vs-literal`` compares instead the two implementations of the full MCPO loss on the same batch: the fused
``policy_loss`` training calls and the literal definition ``literal_policy_loss`` (autograd through plain torch
ops): time, the bytes autograd keeps from the forward to the backward pass beyond the inputs, and the peak memory
growth over forward + backward (resident set on CPU, the CUDA allocator's peak with ``--device cuda``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from machine import describe

from mcpo_megatron.algorithms import (
    LossInputs,
    group_advantages,
    literal_policy_loss,
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
    pg_w, hk_w = token_weights(mask, mastered, loss_agg_mode="seq-mean-token-mean", global_counts=counts)
    return dict(mask=mask, old=old, logp=logp, adv_mcpo=adv_mcpo.float(), adv_dapo=adv_dapo.float(),
                pg_w=pg_w, hk_w=hk_w, T=T)


def run_once(b, arm: str) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of one forward + backward."""
    logp = b["logp"].clone().requires_grad_(True)
    c0, t0 = time.process_time(), time.perf_counter()
    if arm == "mcpo":
        loss, _ = policy_loss(LossInputs(logp, b["old"], b["adv_mcpo"], b["pg_w"], b["mask"], hkl_weight=b["hk_w"]))
    else:
        loss, _ = policy_loss(LossInputs(logp, b["old"], b["adv_dapo"], b["pg_w"], b["mask"]))
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
    ap.add_argument("--vs-literal", action="store_true",
                    help="compare the fused policy_loss with the literal definition instead (time and memory)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where --vs-literal runs (cpu)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.seqs % args.group_size:
        ap.error(f"--seqs={args.seqs} must be a multiple of --group-size={args.group_size}")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device=cuda: this machine has no CUDA device; use --device=cpu")
    if args.vs_literal:
        return compare_literal(args)

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


IMPLEMENTATIONS = {"fused": policy_loss, "literal": literal_policy_loss}


def run_impl(b, name: str, device: torch.device) -> float:
    """Seconds of one forward + backward of the full MCPO loss: process CPU time on CPU, synchronised wall
    clock on a GPU."""
    logp = b["logp"].clone().requires_grad_(True)
    on_gpu = device.type == "cuda"
    if on_gpu:
        torch.cuda.synchronize()
    t0 = time.perf_counter() if on_gpu else time.process_time()
    loss, _ = IMPLEMENTATIONS[name](LossInputs(logp, b["old"], b["adv_mcpo"], b["pg_w"], b["mask"],
                                               hkl_weight=b["hk_w"]))
    loss.backward()
    if on_gpu:
        torch.cuda.synchronize()
    return (time.perf_counter() if on_gpu else time.process_time()) - t0


def saved_for_backward_bytes(b, name: str) -> int:
    """Bytes autograd keeps from the forward pass for the backward pass, not counting the inputs' own storage."""
    logp = b["logp"].clone().requires_grad_(True)
    inputs = {t.untyped_storage().data_ptr() for t in (logp, b["old"], b["adv_mcpo"], b["pg_w"], b["mask"], b["hk_w"])}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in inputs:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, _ = IMPLEMENTATIONS[name](LossInputs(logp, b["old"], b["adv_mcpo"], b["pg_w"], b["mask"],
                                                   hkl_weight=b["hk_w"]))
    loss.backward()
    return sum(saved.values())


def peak_bytes(b, name: str, device: torch.device) -> int:
    """Peak memory growth over one forward + backward (the gradient of logp included)."""
    from bench_logprobs import peak_cuda, peak_rss

    out: dict = {}
    with (peak_cuda if device.type == "cuda" else peak_rss)(out):
        run_impl(b, name, device)
    return out["peak_bytes"]


def compare_literal(args) -> int:
    device = torch.device(args.device)
    print(f"fused policy_loss vs literal_policy_loss, full MCPO loss forward+backward on {device.type}, float32, "
          f"{args.tokens} tokens / {args.seqs} sequences, G={args.group_size}, threads={torch.get_num_threads()}, "
          f"median of {args.repeats}")
    print(describe())
    header = (f"{'mastered':>9} {'B x T':>14} {'fused ms':>9} {'literal ms':>10} {'ratio':>6} "
              f"{'fused saved MiB':>15} {'literal saved MiB':>17} {'fused peak MiB':>14} {'literal peak MiB':>16}")
    print(header)
    print("-" * len(header))
    mib = 2.0 ** 20
    for frac in args.mastered_frac:
        b = {k: v.to(device) if isinstance(v, torch.Tensor) else v
             for k, v in make_batch(args.tokens, args.seqs, args.group_size, frac, args.seed).items()}
        for _ in range(args.warmup):
            for name in IMPLEMENTATIONS:
                run_impl(b, name, device)
        times: dict[str, list[float]] = {name: [] for name in IMPLEMENTATIONS}
        for _ in range(args.repeats):  # interleaved so drifts in machine load hit both alike
            for name in IMPLEMENTATIONS:
                times[name].append(run_impl(b, name, device))
        ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        saved = {name: saved_for_backward_bytes(b, name) / mib for name in IMPLEMENTATIONS}
        peak = {name: max(peak_bytes(b, name, device) for _ in range(min(3, args.repeats))) / mib
                for name in IMPLEMENTATIONS}
        shape = f"{b['mask'].shape[0]} x {b['T']}"
        print(f"{frac:>9.2f} {shape:>14} {ms['fused']:>9.2f} {ms['literal']:>10.2f} "
              f"{ms['literal'] / ms['fused']:>6.2f} {saved['fused']:>15.1f} {saved['literal']:>17.1f} "
              f"{peak['fused']:>14.1f} {peak['literal']:>16.1f}")
    print("ms per forward + backward (median process CPU time; synchronised wall clock on a GPU); saved = bytes kept "
          "for the backward pass beyond the inputs; peak = memory growth over forward + backward, the largest of 3 "
          "(of --repeats if fewer)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
