"""Resharding throughput: Megatron TP shards -> rollout engine, vs a plain memory copy on the same device.

A Qwen3-shaped model (default ~1.1B parameters: hidden 2048, 16 layers, FFN 6144,
16 heads / 8 KV heads, vocab 151936, tied embeddings) is built directly with
random (uninitialised) weights at ``--tp`` ranks (gloo on CPU, NCCL on GPUs, one
GPU per rank).  Rows:

* ``TP=t -> TP=1``: ``Resharder.push`` into a ``TorchRolloutEngine``
  (transformers model, same dtype, on the rank's device) on every rank: the TP
  all-gathers (none at TP=1) + HF layout conversion + bucketed copies into the engine;
* ``all_gather`` (TP > 1 only): the TP all-gathers of every parameter alone
  (received bytes), to show how much of the first row is communication;
* ``memcpy``: each rank copies the same number of bytes (``dst.copy_(src)`` on
  bucket-sized buffers on its device), all ranks at once, measured in the same run.

Each row is the best of ``--repeats`` pushes (the first one also touches fresh
engine memory).  GB = 1e9 bytes, counted once per rank (bytes the engine receives).
``--json PATH`` also writes the figures (rank 0).

    python bench/bench_reshard.py                 # ~1.1B, bf16 (CPU: about 9 GB of RAM for both ranks)
    python bench/bench_reshard.py --layers 4      # smaller
    python bench/bench_reshard.py --tp 1          # one process (one GPU): the copy and layout conversion only
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from machine import describe

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=16, help="decoder layers (16 gives ~1.1B parameters)")
    p.add_argument("--hidden", type=int, default=2048, help="hidden size")
    p.add_argument("--ffn", type=int, default=6144, help="MLP intermediate size")
    p.add_argument("--vocab", type=int, default=151936, help="vocabulary size")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="weight dtype")
    p.add_argument("--tp", type=int, default=None,
                   help="tensor-parallel size = processes (default 2; on GPUs at most the number of GPUs)")
    p.add_argument("--bucket-mb", type=float, default=512, help="reshard bucket size (MiB)")
    p.add_argument("--repeats", type=int, default=2, help="pushes per row (best is reported)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--json", default=None, help="also write the figures to this JSON file (rank 0)")
    args = p.parse_args(argv)
    if args.tp is not None and args.tp < 1:
        p.error(f"--tp={args.tp} must be >= 1")
    return args


def default_tp(gpus: int) -> int:
    """2 ranks on CPU; on GPUs one rank per GPU, at most 2 (NCCL refuses two ranks on one GPU)."""
    return 2 if gpus == 0 else min(2, gpus)


def qwen3_config(args):
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
                       num_hidden_layers=args.layers, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=args.hidden // 16, tie_word_embeddings=True, max_position_embeddings=4096)


def best_of(repeats: int, fn) -> float:
    """The shortest wall time of ``repeats`` calls of ``fn`` (each after a barrier)."""
    import torch.distributed as dist

    best = float("inf")
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    from mcpo_megatron import accounting
    from mcpo_megatron.models.builder import build_gpt_model
    from mcpo_megatron.parallel.distributed import destroy_distributed, init_distributed
    from mcpo_megatron.rollout.reshard import Resharder
    from mcpo_megatron.rollout.torch_engine import TorchRolloutEngine

    tp = int(os.environ["WORLD_SIZE"])
    info = init_distributed(tp, 1)
    device = info.device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    cfg = qwen3_config(args)
    model = build_gpt_model(cfg, dtype=dtype, config_overrides={"perform_initialization": False})
    n_params_local = sum(p.numel() for p in model.parameters())
    resharder = Resharder([model], cfg, bucket_mb=args.bucket_mb, parallel_info=info)
    engine = TorchRolloutEngine(cfg, dtype=dtype, device=device)
    n_params = sum(p.numel() for p in engine.model.parameters())

    best = None
    for _ in range(args.repeats):
        dist.barrier()
        s = resharder.push(engine)  # synchronises the device before and after
        best = s if best is None or s.seconds < best.seconds else best
    del engine
    comm_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) * tp

    def gather_all():  # the TP all-gather alone, parameter by parameter (the communication part of a push)
        for p in model.parameters():
            parts = [torch.empty_like(p) for _ in range(tp)]
            dist.all_gather(parts, p.detach().contiguous(), group=info.tp_group)
            del parts
        sync()

    gather_s = best_of(args.repeats, gather_all) if tp > 1 else None

    # Plain copy of the push's bytes in bucket-sized pieces on the same device (buffers far larger than the
    # CPU caches, reused so the baseline needs one bucket of extra memory), all ranks at once.
    elem = torch.empty((), dtype=dtype).element_size()
    piece = max(1, min(int(args.bucket_mb * 2**20), best.bytes) // elem)
    src = torch.empty(piece, dtype=dtype, device=device).normal_()
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch the destination pages once
    copies = max(1, round(best.bytes / (piece * elem)))
    copy_bytes = copies * piece * elem

    def copy_all():
        for _ in range(copies):
            dst.copy_(src)
        sync()

    copy_s = best_of(args.repeats, copy_all)
    del src, dst
    peak = accounting.peak_memory_bytes()
    gathered = [None] * info.world_size
    dist.all_gather_object(gathered, dict(push_s=best.seconds, gather_s=gather_s, copy_s=copy_s, peak_bytes=peak))
    if info.rank == 0:
        slowest = {k: max(g[k] for g in gathered) if gathered[0][k] is not None else None for k in gathered[0]}
        rows = [(f"TP={tp} -> TP=1 {'gather' if tp > 1 else 'copy'} (torch engine)", best.bytes, slowest["push_s"],
                 best.buckets)]
        if tp > 1:
            rows.append((f"{dist.get_backend(info.tp_group)} all_gather of the TP shards only", comm_bytes,
                         slowest["gather_s"], None))
        rows.append((f"memcpy (same bytes, {'all ranks' if tp > 1 else 'one rank'})", copy_bytes, slowest["copy_s"],
                     None))
        copy_gbps = copy_bytes / slowest["copy_s"] / 1e9
        print(f"\nReshard benchmark: Qwen3-shaped, {n_params / 1e9:.2f}B parameters ({args.layers} layers, "
              f"hidden {args.hidden}, vocab {args.vocab}), {args.dtype}, {tp} process(es) on {device.type}, "
              f"{args.threads} thread(s) each, bucket {args.bucket_mb:g} MiB; local shard "
              f"{n_params_local / 1e9:.2f}B params")
        print(describe())
        print(f"{'path':44s} {'GB/rank':>8s} {'seconds':>8s} {'GB/s':>8s} {'x memcpy':>9s} {'buckets':>8s}")
        figures = []
        for label, nbytes, secs, buckets in rows:
            gbps = nbytes / secs / 1e9
            print(f"{label:44s} {nbytes / 1e9:8.3f} {secs:8.3f} {gbps:8.2f} {gbps / copy_gbps:9.3f} "
                  f"{buckets if buckets is not None else '-':>8}")
            figures.append(dict(path=label, bytes=nbytes, seconds=secs, gbps=gbps, buckets=buckets))
        where = "GPU memory allocated" if device.type == "cuda" else "RSS"
        peaks = ", ".join(f"{g['peak_bytes'] / 2**30:.2f} GiB" for g in gathered)
        print(f"peak {where} per rank: {peaks}")
        if args.json:
            Path(args.json).write_text(json.dumps(dict(
                machine=describe(), device=device.type, tp=tp, dtype=args.dtype, params=n_params,
                layers=args.layers, hidden=args.hidden, vocab=args.vocab, bucket_mb=args.bucket_mb,
                push_gbps=best.bytes / slowest["push_s"] / 1e9, memcpy_gbps=copy_gbps, rows=figures,
                peak_bytes=[g["peak_bytes"] for g in gathered]), indent=2))
    destroy_distributed()


def main(argv=None) -> int:
    args = parse_args(argv)
    if "WORLD_SIZE" in os.environ:
        worker(args)
        return 0
    import torch

    from mcpo_megatron.parallel.distributed import free_port

    tp = args.tp or default_tp(torch.cuda.device_count() if torch.cuda.is_available() else 0)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads),
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(tp), "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(Path(__file__).resolve()), *(argv or sys.argv[1:])]
    return subprocess.call(cmd, env=env, cwd=str(REPO))


if __name__ == "__main__":
    sys.exit(main())
