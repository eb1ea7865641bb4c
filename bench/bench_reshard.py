"""The weight update's throughput: Megatron shards -> a rollout engine, against a plain copy of the same bytes.

A Qwen3-shaped model (default ~1.1B parameters: hidden 2048, 16 layers, FFN 6144, 16 heads / 8 KV heads, vocab
151936, tied embeddings; ``--moe``: a Qwen3-MoE-shaped one) is built at each training layout with its weights
written (random values, so that every page is real memory and no read hits the kernel's zero page). One torchrun
launch per layout (gloo on CPU, NCCL on GPUs, one GPU per rank); in each, the variants are timed in turn,
``--repeats`` rounds, and the best of each is reported (the slowest rank's time):

* ``plan -> <engine>``: ``Resharder.push`` through the compiled reshard plan (the trainer's path): pieces a rank
  holds copied straight into the engine's tensors, the others exchanged with one ``all_to_all`` per round;
* ``stream -> <engine>``: the Hugging Face stream into the same engine (what engines without a weight target get);
* engines: ``torch`` (the PyTorch engine: every rank holds the whole model), ``vllm-layout TP=r`` (vLLM's tensors
  at rollout TP r, allocated as plain tensors: what a GPU vLLM engine is written in place), and ``vllm-cpu`` (the
  real vLLM CPU engine, its matrices re-packed after the update; ``re-pack alone`` times that re-pack);
* ``plain copy``: the same bytes copied between two preallocated buffers on the device (warm memory).

Columns: bytes written into each rank's engine per update (GB = 1e9 B), seconds, GB/s, that over the plain copy
(``x copy``), and the collectives of one update on a rank (``coll``). ``--json PATH`` writes the figures.

    python bench/bench_reshard.py                                 # every layout, ~1.1B bf16 (CPU: ~10 min)
    python bench/bench_reshard.py --layouts tp1,tp2 --layers 4    # smaller
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from machine import describe

REPO = Path(__file__).resolve().parents[1]
# layout -> (processes, tp, pp, ep, moe, engines)
LAYOUTS = {
    "tp1": (1, 1, 1, 1, False, ("torch", "vllm-layout:1")),
    "tp2": (2, 2, 1, 1, False, ("torch", "vllm-layout:2")),
    "pp2": (2, 1, 2, 1, False, ("torch",)),
    "ep2": (2, 1, 1, 2, True, ("torch",)),
    "vllm": (1, 1, 1, 1, False, ("vllm-cpu",)),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {', '.join(LAYOUTS)}")
    p.add_argument("--layers", type=int, default=16, help="decoder layers (16 gives ~1.1B parameters)")
    p.add_argument("--hidden", type=int, default=2048, help="hidden size")
    p.add_argument("--ffn", type=int, default=6144, help="MLP intermediate size (dense)")
    p.add_argument("--vocab", type=int, default=151936, help="vocabulary size")
    p.add_argument("--experts", type=int, default=16, help="experts per layer (--moe layouts)")
    p.add_argument("--expert-ffn", type=int, default=768, help="expert width (--moe layouts)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="weight dtype")
    p.add_argument("--bucket-mb", type=float, default=512, help="reshard.bucket_mb")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds of every variant (best is reported)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--json", default=None, help="also write the figures to this JSON file")
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)   # a worker's result file
    p.add_argument("--layout", default=None, help=argparse.SUPPRESS)  # a worker's layout
    args = p.parse_args(argv)
    unknown = [x for x in args.layouts.split(",") if x not in LAYOUTS]
    if unknown:
        p.error(f"--layouts: unknown {unknown}; choose from {', '.join(LAYOUTS)}")
    return args


def model_config(args, moe: bool):
    from transformers import Qwen3Config, Qwen3MoeConfig

    common = dict(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=args.hidden // 16,
                  tie_word_embeddings=True, max_position_embeddings=4096)
    if moe:
        cfg = Qwen3MoeConfig(intermediate_size=args.ffn, num_experts=args.experts, num_experts_per_tok=2,
                             moe_intermediate_size=args.expert_ffn, **common)
        cfg.architectures = ["Qwen3MoeForCausalLM"]
    else:
        cfg = Qwen3Config(intermediate_size=args.ffn, **common)
        cfg.architectures = ["Qwen3ForCausalLM"]
    return cfg


class Tensors:
    """An engine that is only its tensors in a given layout (vLLM's on GPUs are written this way)."""

    def __init__(self, target):
        self.target = target

    def weight_target(self):
        return self.target


def vllm_layout_engine(shape, r: int, rank: int, dtype, device):
    import torch

    from mcpo_megatron.rollout.weights.layouts import EngineLayout, engine_tensor_shapes
    from mcpo_megatron.rollout.weights.target import WeightTarget
    from mcpo_megatron.rollout.weights.transfer import dtype_name

    padded = -(-shape.vocab_size // 64) * 64  # vLLM pads its vocabulary to a multiple of 64
    layout = EngineLayout("vllm", dtype_name(dtype), tp=r, tp_rank=rank % r, vocab_padded=padded, replica=rank // r)
    tensors = {k: torch.zeros(s, dtype=dtype, device=device) for k, s in engine_tensor_shapes(shape, layout).items()}
    return Tensors(WeightTarget(layout, tensors))


def vllm_cpu_engine(cfg, dtype):
    """vLLM's CPU engine for ``cfg`` (random weights), in this process (a torchrun world of one)."""
    from mcpo_megatron.rollout.engines.vllm.engine import VLLMRolloutEngine

    model_dir = tempfile.mkdtemp(prefix="bench_reshard_model_")
    cfg.save_pretrained(model_dir)
    return VLLMRolloutEngine(model_dir, rollout_tp=1, dtype="bfloat16" if str(dtype).endswith("bfloat16")
                             else "float32", seed=0, load_format="dummy", max_model_len=256, max_num_seqs=4,
                             kv_cache_bytes=64 * 2**20)


def random_chunks(cfg, info, dtype):
    """This rank's model chunks with random weights written into every page (reads never hit the kernel's zero
    page)."""
    import torch

    from mcpo_megatron.models.builder import build_model_chunks

    chunks = build_model_chunks(cfg, dtype=dtype, config_overrides={"perform_initialization": False})
    gen = torch.Generator(device=info.device).manual_seed(info.rank)
    with torch.no_grad():
        for c in chunks:
            for p in c.parameters():
                p.normal_(0.0, 0.02, generator=gen)
    return chunks


def push_variants(engines, resharder, cfg, shape, info, dtype) -> tuple[dict, list]:
    """({label: a function returning the push's ReshardStats}, the engines to close) for the layout's engines."""
    from mcpo_megatron.rollout.engines.torch.engine import TorchRolloutEngine

    variants, closing = {}, []
    for name in engines:
        if name == "torch":
            engine = TorchRolloutEngine(cfg, dtype=dtype, device=info.device)
            variants["plan -> torch engine"] = (lambda e=engine: resharder.push(e))
            variants["stream -> torch engine"] = (lambda e=engine: resharder.push(e, stream=True))
        elif name.startswith("vllm-layout"):
            r = int(name.split(":")[1])
            engine = vllm_layout_engine(shape, r, info.rank, dtype, info.device)
            variants[f"plan -> vllm-layout TP={r}"] = (lambda e=engine: resharder.push(e))
        else:
            engine = vllm_cpu_engine(cfg, dtype)
            closing.append(engine)
            variants["plan -> vllm-cpu (with re-pack)"] = (lambda e=engine: resharder.push(e))
            variants["stream -> vllm-cpu (layerwise reload)"] = (lambda e=engine: resharder.push(e, stream=True))
            target = engine.weight_target()
            variants["re-pack alone (vllm-cpu)"] = (lambda t=target: _timed_call(t.finish))
    return variants, closing


def plain_copy_of(nbytes: int, bucket_mb: float, dtype, device):
    """(a function copying ``nbytes`` in bucket-sized pieces between two warm buffers, the bytes it copies)."""
    import torch

    piece = min(int(bucket_mb * 2**20), nbytes) // torch.empty((), dtype=dtype).element_size()
    src = torch.empty(piece, dtype=dtype, device=device).normal_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    copies = max(1, round(nbytes / (piece * src.element_size())))

    def plain_copy():
        for _ in range(copies):
            dst.copy_(src)
        return None

    return plain_copy, copies * piece * src.element_size()


def time_interleaved(variants: dict, repeats: int, sync) -> tuple[dict, dict]:
    """({label: best seconds}, {label: collectives of a push}) over ``repeats`` rounds, every variant once a
    round, each between a barrier and a device sync."""
    import torch.distributed as dist

    best: dict[str, float] = {}
    coll: dict[str, int] = {}
    for _ in range(repeats):
        for label, fn in variants.items():
            dist.barrier()
            sync()
            t0 = time.perf_counter()
            s = fn()
            sync()
            dt = time.perf_counter() - t0
            best[label] = min(best.get(label, float("inf")), dt)
            if hasattr(s, "collectives"):
                coll[label] = s.collectives
    return best, coll


def worker(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    from mcpo_megatron.parallel.distributed import all_gather_objects, destroy_distributed, init_distributed
    from mcpo_megatron.rollout.weights.resharder import Resharder

    procs, tp, pp, ep, moe, engines = LAYOUTS[args.layout]
    info = init_distributed(tp, pp, ep=ep)
    device, rank = info.device, info.rank
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    cfg = model_config(args, moe)
    chunks = random_chunks(cfg, info, dtype)
    shape = chunks[0].mcpo_shape
    resharder = Resharder(chunks, cfg, bucket_mb=args.bucket_mb, parallel_info=info)
    variants, closing = push_variants(engines, resharder, cfg, shape, info, dtype)
    for fn in variants.values():  # warm-up: compiles the plan, touches every destination page
        fn()

    nbytes = {}
    for label, fn in variants.items():
        s = fn()
        nbytes[label] = s.bytes if hasattr(s, "bytes") else None
    plain_bytes = max(b for b in nbytes.values() if b)
    for label in variants:
        nbytes[label] = nbytes[label] or plain_bytes
    plain = "plain copy (same bytes, warm)"
    variants[plain], nbytes[plain] = plain_copy_of(plain_bytes, args.bucket_mb, dtype, device)

    best, coll = time_interleaved(variants, args.repeats, sync)
    gathered = all_gather_objects(best)
    if rank == 0:
        rows = []
        for label in variants:
            seconds = max(g[label] for g in gathered)
            rows.append(dict(layout=args.layout, path=label, bytes=nbytes[label], seconds=seconds,
                             gbps=nbytes[label] / seconds / 1e9, collectives=coll.get(label)))
        Path(args.out).write_text(json.dumps(dict(rows=rows, params=shape_params(shape), device=device.type,
                                                  processes=procs)))
    for engine in closing:  # vLLM's shutdown before the process group's
        engine.close()
    destroy_distributed()


def shape_params(shape) -> int:
    """The model's parameters (the HF tensors' elements)."""
    import math

    from mcpo_megatron.models import weights

    return sum(math.prod(s) for rule in weights.param_rules(shape) for s in weights.hf_tensor_shapes(shape, rule))


def _timed_call(fn):
    fn()
    return None


def main(argv=None) -> int:
    args = parse_args(argv)
    if "WORLD_SIZE" in os.environ:
        worker(args)
        return 0
    from mcpo_megatron.parallel.distributed import free_port

    results = []
    for layout in args.layouts.split(","):
        procs = LAYOUTS[layout][0]
        out = Path(tempfile.mkdtemp(prefix="bench_reshard_")) / "result.json"
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads),
                   PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        argv_worker = [a for a in (argv if argv is not None else sys.argv[1:])]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(procs), "--master_addr",
               "127.0.0.1", "--master_port", str(free_port()), str(Path(__file__).resolve()), *argv_worker,
               "--layout", layout, "--out", str(out)]
        rc = subprocess.call(cmd, env=env, cwd=str(REPO))
        if rc != 0:
            print(f"layout {layout}: the workers failed (exit {rc})", file=sys.stderr)
            return rc
        results.append(json.loads(out.read_text()))
    print_table(args, results)
    return 0


def print_table(args, results) -> None:
    print(f"\nWeight update benchmark: Qwen3-shaped, {args.layers} layers, hidden {args.hidden}, vocab {args.vocab} "
          f"(MoE: {args.experts} experts of {args.expert_ffn}), {args.dtype}, bucket {args.bucket_mb:g} MiB, "
          f"{args.threads} thread(s) per process, best of {args.repeats}")
    print(describe())
    print(f"{'path':50s}  {'GB/rank':>8s}  {'seconds':>8s}  {'GB/s':>7s}  {'x copy':>7s}  {'coll':>5s}")
    figures = []
    for res in results:
        copy = next(r for r in res["rows"] if r["path"].startswith("plain copy"))
        for r in res["rows"]:
            r["x_copy"] = r["gbps"] / copy["gbps"]
            coll = "-" if r["collectives"] is None else str(r["collectives"])
            label = f"{r['layout']}: {r['path']}"
            print(f"{label:50s}  {r['bytes'] / 1e9:8.3f}  {r['seconds']:8.3f}  {r['gbps']:7.2f}  {r['x_copy']:7.3f}  "
                  f"{coll:>5s}")
            figures.append(r)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(machine=describe(), dtype=args.dtype, layers=args.layers,
                                                   hidden=args.hidden, vocab=args.vocab, bucket_mb=args.bucket_mb,
                                                   params={res["rows"][0]["layout"]: res["params"] for res in results},
                                                   rows=figures), indent=2))


if __name__ == "__main__":
    sys.exit(main())
