"""Resharding throughput on CPU/gloo: Megatron TP=2 shards -> rollout engine, vs a plain memory copy.

A Qwen3-shaped model (default ~1.1B parameters: hidden 2048, 16 layers, FFN 6144,
16 heads / 8 KV heads, vocab 151936, tied embeddings) is built directly with
random (uninitialised) weights at TP=2 on two gloo processes.  Rows:

* ``TP=2 -> TP=1 gather``: ``Resharder.push`` into a ``TorchRolloutEngine``
  (transformers model, same dtype) on every rank: TP all-gathers + HF layout
  conversion + bucketed copies into the engine;
* ``gloo all_gather``: only the TP all-gathers of every parameter (received
  bytes), to show how much of the gather row is communication;
* ``memcpy``: each rank copies the same number of bytes (``dst.copy_(src)`` on
  bucket-sized buffers), both ranks at once, measured in the same run.

Each row is the best of ``--repeats`` pushes (the first one also touches fresh
engine memory).  GB = 1e9 bytes, counted once per rank (bytes the engine receives).

    python bench/bench_reshard.py                 # ~1.1B, bf16 (about 9 GB of RAM for both ranks)
    python bench/bench_reshard.py --layers 4      # smaller
"""

from __future__ import annotations

import argparse
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
    p.add_argument("--bucket-mb", type=float, default=512, help="reshard bucket size (MiB)")
    p.add_argument("--repeats", type=int, default=2, help="pushes per row (best is reported)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    return p.parse_args(argv)


def qwen3_config(args):
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
                       num_hidden_layers=args.layers, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=args.hidden // 16, tie_word_embeddings=True, max_position_embeddings=4096)


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    from mcpo_megatron.models.builder import build_gpt_model
    from mcpo_megatron.parallel.distributed import destroy_distributed, init_distributed
    from mcpo_megatron.rollout.reshard import Resharder
    from mcpo_megatron.rollout.torch_engine import TorchRolloutEngine

    info = init_distributed(2, 1)
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    cfg = qwen3_config(args)
    model = build_gpt_model(cfg, dtype=dtype, config_overrides={"perform_initialization": False})
    n_params_local = sum(p.numel() for p in model.parameters())
    resharder = Resharder([model], cfg, bucket_mb=args.bucket_mb, parallel_info=info)
    engine = TorchRolloutEngine(cfg, dtype=dtype)
    n_params = sum(p.numel() for p in engine.model.parameters())

    rows = []
    best = None
    for _ in range(args.repeats):
        dist.barrier()
        s = resharder.push(engine)
        best = s if best is None or s.seconds < best.seconds else best
    rows.append(("TP=2 -> TP=1 gather (torch engine)", best))
    del engine

    # The TP all-gather alone (gloo), parameter by parameter: the communication part of the gather row.
    ag_best = None
    for _ in range(args.repeats):
        dist.barrier()
        t0 = time.perf_counter()
        for p in model.parameters():
            parts = [torch.empty_like(p) for _ in range(info.tp)]
            dist.all_gather(parts, p.detach().contiguous(), group=info.tp_group)
            del parts
        dt = time.perf_counter() - t0
        ag_best = dt if ag_best is None else min(ag_best, dt)
    ag_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) * info.tp

    # Plain copy of the gather row's bytes in bucket-sized pieces (buffers far larger than the
    # CPU caches, reused so the baseline needs one bucket of extra memory), both ranks at once.
    elem = torch.empty((), dtype=dtype).element_size()
    piece = max(1, min(int(args.bucket_mb * 2**20), best.bytes) // elem)
    src = torch.empty(piece, dtype=dtype).normal_()
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch the destination pages once
    copies = max(1, round(best.bytes / (piece * elem)))
    copy_bytes = copies * piece * elem
    copy_best = None
    for _ in range(args.repeats):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(copies):
            dst.copy_(src)
        dt = time.perf_counter() - t0
        copy_best = dt if copy_best is None else min(copy_best, dt)
    del src, dst
    import resource

    gathered = [None] * info.world_size
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    dist.all_gather_object(gathered, (rows[0][1].seconds, rows[1][1].seconds, copy_best, peak_rss, ag_best))
    if info.rank == 0:
        copy_gbps = copy_bytes / max(g[2] for g in gathered) / 1e9
        print(f"\nReshard benchmark: Qwen3-shaped, {n_params / 1e9:.2f}B parameters ({args.layers} layers, "
              f"hidden {args.hidden}, vocab {args.vocab}), {args.dtype}, 2 gloo processes, "
              f"{args.threads} thread(s) each, bucket {args.bucket_mb:g} MiB; local shard "
              f"{n_params_local / 1e9:.2f}B params")
        print(describe())
        print(f"{'path':40s} {'GB/rank':>8s} {'seconds':>8s} {'GB/s':>7s} {'x memcpy':>9s} {'buckets':>8s}")
        for k, (label, st) in enumerate(rows):
            secs = max(g[k] for g in gathered)  # slowest rank finishes the update
            gbps = st.bytes / secs / 1e9
            print(f"{label:40s} {st.bytes / 1e9:8.3f} {secs:8.3f} {gbps:7.2f} {gbps / copy_gbps:9.3f} "
                  f"{st.buckets:8d}")
        ag_secs = max(g[4] for g in gathered)
        ag_gbps = ag_bytes / ag_secs / 1e9
        print(f"{'gloo all_gather of the TP shards only':40s} {ag_bytes / 1e9:8.3f} {ag_secs:8.3f} {ag_gbps:7.2f} "
              f"{ag_gbps / copy_gbps:9.3f} {'-':>8s}")
        print(f"{'memcpy (same bytes, both ranks)':40s} {copy_bytes / 1e9:8.3f} "
              f"{max(g[2] for g in gathered):8.3f} {copy_gbps:7.2f} {1.0:9.3f} {'-':>8s}")
        print(f"peak RSS per rank: {', '.join(f'{g[3] / 2**30:.2f} GiB' for g in gathered)}")
    destroy_distributed()


def main(argv=None) -> int:
    args = parse_args(argv)
    if "WORLD_SIZE" in os.environ:
        worker(args)
        return 0
    from mcpo_megatron.parallel.distributed import free_port

    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(Path(__file__).resolve()), *(argv or sys.argv[1:])]
    return subprocess.call(cmd, env=env, cwd=str(REPO))


if __name__ == "__main__":
    sys.exit(main())
