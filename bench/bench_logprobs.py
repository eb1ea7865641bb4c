"""Benchmark: chunked vocab-parallel log-probs + entropy vs a naive full-vocabulary log_softmax.

Both compute, on every tensor-parallel rank, per-token log-probs of the sampled
tokens and the softmax entropy from vocabulary-sharded logits, then the
gradient of ``sum(w1 * logp + w2 * entropy)`` w.r.t. this rank's shard
(forward + backward):

* naive:   megatron's ``gather_from_tensor_model_parallel_region`` (all-gather
           to the full vocabulary; backward keeps this rank's slice), then
           ``torch.log_softmax`` over the full vocabulary, entropy from it, autograd.
* chunked: ``mcpo_megatron.parallel.logprobs.vocab_parallel_logprobs`` (token
           chunks, TP all-reduces of max / sum-exp / target logit, own backward);
           also with ``inplace_backward=True`` (gradient written over the logits).

The logits live on ``--device`` (``auto``: the GPU when there is one, one GPU
per rank; the collectives then run over NCCL, else over gloo).

Peak memory per rank on CPU is the high-water mark of the process's resident set
(``VmHWM`` in /proc/self/status) during forward + backward, minus the resident
set just before (after ``gc`` and ``malloc_trim``); the high-water mark is reset
before each method by writing ``5`` to /proc/self/clear_refs.  PyTorch's CPU
allocator does not cache: every tensor is a malloc, and the large ones are
mmap'ed and unmapped on free, so resident memory follows live tensors.  On a GPU
it is the CUDA allocator's peak of allocated bytes during the call minus the
bytes allocated just before (``torch.cuda.max_memory_allocated`` after
``reset_peak_memory_stats``).  The logits shard itself is allocated before the
baseline; the gradient w.r.t. it is counted (it is part of the backward's
memory).  Time is the slowest rank's wall-clock time of forward + backward (best
of ``--repeats``; the GPU is synchronised before and after).  ``--json PATH``
also writes the figures (rank 0).

Run it directly: it relaunches itself under ``torch.distributed.run`` with
``--tp`` processes.  Examples (2 cores; one GPU):

    python bench/bench_logprobs.py --tokens 2048 --vocab 151936 --tp 2
    python bench/bench_logprobs.py --tokens 8192 --tp 1 --dtype bf16 --device cuda
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from machine import describe

REPO_ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Peak memory and time of chunked vocab-parallel log-probs + entropy "
        "(forward + backward) against a naive full-vocabulary log_softmax, at TP on CPU (gloo) or GPUs (NCCL).",
    )
    p.add_argument("--tokens", type=int, default=8192, help="tokens (rows of logits); default 8192")
    p.add_argument("--vocab", type=int, default=151936, help="full vocabulary size; default 151936 (Qwen3)")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size = processes; default 2")
    p.add_argument("--chunk-size", type=int, default=128, help="tokens per chunk; default 128")
    p.add_argument("--temperature", type=float, default=1.0, help="softmax temperature; default 1.0")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="logits dtype; default fp32")
    p.add_argument("--repeats", type=int, default=1, help="timed repeats per method (best is kept)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process; default 1")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="where the logits live (auto: cuda when available; one GPU per rank)")
    p.add_argument("--json", default=None, help="also write the figures to this JSON file (rank 0)")
    p.add_argument(
        "--no-fit", action="store_true",
        help="do not shrink --tokens to what the naive method fits in available memory",
    )
    args = p.parse_args(argv)
    for key in ("tokens", "vocab", "tp", "chunk_size", "repeats", "threads"):
        if getattr(args, key) < 1:
            p.error(f"--{key.replace('_', '-')}={getattr(args, key)} must be >= 1")
    if args.vocab % args.tp:
        p.error(f"--vocab={args.vocab} must be divisible by --tp={args.tp} (megatron pads it so)")
    return args


def resolve_device(choice: str, tp: int) -> str:
    """``cpu`` or ``cuda`` for ``--device``; a GPU run needs one GPU per rank (NCCL refuses two ranks on one)."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = ("cuda" if gpus else "cpu") if choice == "auto" else choice
    if device == "cuda" and gpus < tp:
        raise SystemExit(f"--device cuda with --tp={tp} needs {tp} GPUs (one per rank); this machine has {gpus}: "
                         f"lower --tp or use --device cpu")
    return device


# ---------------------------------------------------------------- launcher side


def naive_bytes_per_rank(tokens: int, vocab: int, tp: int) -> int:
    """Rough need of one rank: ~5 full [tokens, vocab] fp32 tensors live in the naive method,
    plus the shard, its copy and the reference gradient held by the benchmark."""
    return 5 * tokens * vocab * 4 + 3 * tokens * (vocab // tp) * 4


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def launch(args: argparse.Namespace, argv: list[str]) -> int:
    """Start ``--tp`` workers under torch.distributed.run with the same arguments ``argv``."""
    tokens = args.tokens
    device = resolve_device(args.device, args.tp)
    if not args.no_fit and device == "cpu":  # on GPUs the worker checks the device's free memory
        budget = 0.5 * mem_available()  # leave room: the machine may be shared
        while tokens > 64 and args.tp * naive_bytes_per_rank(tokens, args.vocab, args.tp) > budget:
            tokens //= 2
        if tokens != args.tokens:
            print(
                f"note: the naive method needs about "
                f"{args.tp * naive_bytes_per_rank(args.tokens, args.vocab, args.tp) / 2**30:.0f} GiB "
                f"for {args.tokens} tokens on {args.tp} ranks but {mem_available() / 2**30:.0f} GiB "
                f"are available; measuring {tokens} tokens instead (--no-fit to insist).\n"
                "Both methods' memory grows linearly with tokens (the chunk work space is fixed), "
                "so the memory ratio at more tokens is at least the one measured here.",
                flush=True,
            )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(args.threads)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env["MCPO_BENCH_TOKENS"] = str(tokens)
    env["MCPO_BENCH_DEVICE"] = device
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.tp),
        "--master_addr", "127.0.0.1", "--master_port", str(port), str(Path(__file__).resolve()),
        *argv,
    ]
    return subprocess.run(cmd, env=env).returncode


# ---------------------------------------------------------------- worker side


def _status_bytes(field: str) -> int:
    from mcpo_megatron.accounting import proc_status_bytes

    value = proc_status_bytes(field)
    if value is None:
        raise RuntimeError(f"{field} not in /proc/self/status")
    return value


_LIBC = ctypes.CDLL("libc.so.6")


@contextmanager
def peak_rss(out: dict):
    """Peak resident-set growth (bytes) over the block, from VmHWM after a reset."""
    gc.collect()
    _LIBC.malloc_trim(0)
    base = _status_bytes("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    yield
    out["peak_bytes"] = _status_bytes("VmHWM") - base


@contextmanager
def peak_cuda(out: dict):
    """Peak growth (bytes) of the CUDA allocator's allocated memory over the block; the device is synchronised
    on both sides so that the block's kernels are inside it."""
    import torch

    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    yield
    torch.cuda.synchronize()
    out["peak_bytes"] = torch.cuda.max_memory_allocated() - base


def check_gpu_fits(tokens: int, vocab: int, tp: int) -> None:
    """Refuse, naming --tokens, a size whose naive method cannot fit in the GPU's free memory."""
    import torch

    free, _ = torch.cuda.mem_get_info()
    need = naive_bytes_per_rank(tokens, vocab, tp)
    if need > 0.9 * free:
        raise SystemExit(f"--tokens={tokens}: the naive method needs about {need / 2**30:.1f} GiB per GPU but "
                         f"{free / 2**30:.1f} GiB are free; lower --tokens")


def time_methods(methods, inputs, chunk_size: int, repeats: int, peak_memory):
    """(rows of (method, peak bytes, seconds), {method: max |diff| of logp, entropy, grad from the first}) of each
    method's forward and backward over ``inputs`` (logits shard, targets, the loss weights of logp and entropy):
    the best of ``repeats``, the largest over the ranks."""
    import torch

    from mcpo_megatron.parallel.distributed import all_reduce_max, barrier

    shard, targets, w_lp, w_h = inputs
    cuda = shard.device.type == "cuda"
    tokens = shard.shape[0]
    # Warm-up on a few rows: first-call costs (gloo buffers, lazy init) stay out of the timings.
    n_warm = min(tokens, 2 * chunk_size)
    for _, fn in methods:
        warm = shard[:n_warm].clone().requires_grad_(True)
        lp, en = fn(warm.view_as(warm), targets[:n_warm])
        torch.autograd.grad((w_lp[:n_warm] * lp).sum() + (w_h[:n_warm] * en).sum(), warm)
    rows, ref, diffs = [], None, {}
    for name, fn in methods:
        best_t, peak = float("inf"), 0
        for _ in range(repeats):
            leaf = shard.clone().requires_grad_(True)  # a fresh copy: in-place overwrites it
            y = leaf.view_as(leaf)  # a non-leaf, as the output layer's logits are
            stats: dict = {}
            barrier()
            with peak_memory(stats):
                t0 = time.perf_counter()
                logp, ent = fn(y, targets)
                loss = (w_lp * logp).sum() + (w_h * ent).sum()
                (grad,) = torch.autograd.grad(loss, y)
                if cuda:
                    torch.cuda.synchronize()
                elapsed = time.perf_counter() - t0
            best_t, peak = min(best_t, elapsed), max(peak, stats["peak_bytes"])
            got = (logp.detach(), ent.detach(), grad.detach())
            if ref is None:
                ref = got
            else:
                d = torch.tensor([float((a.float() - b.float()).abs().max()) for a, b in zip(got, ref)],
                                 dtype=torch.float64)
                all_reduce_max(d)
                diffs[name] = [max(x, y) for x, y in zip(d.tolist(), diffs.get(name, [0.0] * 3))]
            del leaf, y, logp, ent, loss, grad, got
        t = torch.tensor([best_t, float(peak)], dtype=torch.float64)
        all_reduce_max(t)
        rows.append((name, float(t[1]), float(t[0])))
    return rows, diffs


def print_table(args, tokens: int, device, rows, diffs) -> None:
    """The table on rank 0, and its JSON (--json)."""
    temp = args.temperature
    where = f"{device.type}, {'NCCL' if device.type == 'cuda' else f'gloo, {args.threads} thread/rank'}"
    print(f"\nlog-probs + entropy, forward+backward: {tokens} tokens x {args.vocab} vocab, "
          f"TP={args.tp} ({where}), {args.dtype} logits, "
          f"chunk {args.chunk_size} tokens, T={temp}")
    naive_mem, naive_t = rows[0][1], rows[0][2]
    print(describe())
    hdr = (f"{'method':<30} {'peak MiB/rank':>14} {'time s':>8} {'mem naive/x':>12} "
           f"{'time x/naive':>13} {'max|dlogp|':>11} {'max|dH|':>9} {'max|dgrad|':>11}")
    print(hdr)
    print("-" * len(hdr))
    for name, mem, t in rows:
        d = diffs.get(name, [0.0, 0.0, 0.0])
        print(f"{name:<30} {mem / 2**20:>14.1f} {t:>8.2f} {naive_mem / max(mem, 1):>12.1f} "
              f"{t / naive_t:>13.2f} {d[0]:>11.2e} {d[1]:>9.2e} {d[2]:>11.2e}")
    print("goal: peak memory >= 8x lower than naive, time <= 1.2x naive; diffs are max abs "
          "differences from the naive method (log-probs/entropy fp32, gradient in the logits dtype)")
    if args.json:
        methods_out = [dict(method=name, peak_bytes=mem, seconds=t, memory_naive_over=naive_mem / max(mem, 1),
                            time_over_naive=t / naive_t,
                            max_abs_diff=dict(zip(("logp", "entropy", "grad"), diffs.get(name, [0.0] * 3))))
                       for name, mem, t in rows]
        Path(args.json).write_text(json.dumps(dict(
            machine=describe(), device=device.type, tokens=tokens, vocab=args.vocab, tp=args.tp,
            dtype=args.dtype, chunk_size=args.chunk_size, methods=methods_out), indent=2))


def worker(args: argparse.Namespace) -> None:
    import torch

    from mcpo_megatron.parallel.distributed import destroy_distributed, init_distributed
    from mcpo_megatron.parallel.logprobs import vocab_parallel_logprobs

    torch.set_num_threads(args.threads)
    tokens = int(os.environ.get("MCPO_BENCH_TOKENS", args.tokens))
    info = init_distributed(tp=args.tp, pp=1, seed=0)
    device = torch.device(info.device) if os.environ.get("MCPO_BENCH_DEVICE", "cpu") == "cuda" else torch.device("cpu")
    peak_memory = peak_cuda if device.type == "cuda" else peak_rss
    if device.type == "cuda":
        check_gpu_fits(tokens, args.vocab, args.tp)
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    group, vp, temp = info.tp_group, args.vocab // args.tp, args.temperature
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    g = torch.Generator().manual_seed(1000 + info.tp_rank)  # each rank its own shard
    shard = (torch.randn(tokens, vp, generator=g) * 2).to(device=device, dtype=dtype)
    g = torch.Generator().manual_seed(7)  # same targets and weights on every rank
    targets = torch.randint(0, args.vocab, (tokens,), generator=g).to(device)
    w_lp, w_h = torch.randn(tokens, generator=g).to(device), torch.randn(tokens, generator=g).to(device)

    def naive(y, tgt):
        full = gather_from_tensor_model_parallel_region(y, group)
        logp_all = torch.log_softmax(full.float() / temp, dim=-1)
        logp = logp_all.gather(-1, tgt.unsqueeze(-1)).squeeze(-1)
        ent = -(logp_all.exp() * logp_all).sum(-1)
        return logp, ent

    def chunked(y, tgt, inplace=False):
        return vocab_parallel_logprobs(y, tgt, group, chunk_size=args.chunk_size,
                                       temperature=temp, inplace_backward=inplace)

    methods = [
        ("naive full-vocab log_softmax", naive),
        ("chunked vocab-parallel", chunked),
        ("chunked, in-place backward", lambda y, tgt: chunked(y, tgt, inplace=True)),
    ]
    rows, diffs = time_methods(methods, (shard, targets, w_lp, w_h), args.chunk_size, args.repeats, peak_memory)
    if info.rank == 0:
        print_table(args, tokens, device, rows, diffs)
    destroy_distributed()


def main(argv=None) -> int:
    args = parse_args(argv)
    if "RANK" not in os.environ:
        return launch(args, sys.argv[1:] if argv is None else list(argv))
    worker(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
