"""``mcpo plan``: check a parallel layout for a cluster shape and estimate per-GPU memory, before queueing.

    mcpo plan configs/qwen3_32b_mcpo.yaml --nodes 4 --gpus-per-node 8 --gpu-mem-gb 80

The estimates and their formulas are in :mod:`mcpo_megatron.planner`.
"""

from __future__ import annotations

import sys

from mcpo_megatron.planner import (
    DEFAULT_FS_WRITE_GBPS,
    DEFAULT_HOST_MEM_GIB,
    DEFAULT_OFFLOAD_GBPS,
    DEFAULT_GEN_MFU,
    DEFAULT_MFU,
    DEFAULT_RESERVE_GIB,
    H100_PEAK_TFLOPS,
    estimate_preempt_lead,
    format_plan,
    format_preempt_lead,
    format_split,
    plan,
    step_work,
    suggest_split,
)


def _add_arguments(p) -> None:
    from mcpo_megatron.config import add_config_arguments

    add_config_arguments(p)
    p.add_argument("--nodes", type=int, default=1, help="number of nodes (default 1)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs (ranks) per node (default 8)")
    p.add_argument("--gpu-mem-gb", type=float, default=80.0,
                   help="memory of one GPU in GiB (default 80: H100-80GB)")
    p.add_argument("--reserve-gb", type=float, default=DEFAULT_RESERVE_GIB,
                   help=f"per-GPU allowance for CUDA context, NCCL and fragmentation (default {DEFAULT_RESERVE_GIB:g})")
    p.add_argument("--host-mem-gb", type=float, default=DEFAULT_HOST_MEM_GIB,
                   help=f"host RAM of one node in GiB, which holds trainer.offload's pinned copies (default "
                        f"{DEFAULT_HOST_MEM_GIB:g}: a DGX H100)")
    p.add_argument("--offload-gbps", type=float, default=DEFAULT_OFFLOAD_GBPS,
                   help=f"GB/s between pinned host memory and one GPU, for trainer.offload's transfer time (default "
                        f"{DEFAULT_OFFLOAD_GBPS:g})")
    p.add_argument("--peak-tflops", type=float, default=H100_PEAK_TFLOPS,
                   help=f"dense bf16 peak of one GPU in TFLOP/s, for the step-time estimate (default "
                        f"{H100_PEAK_TFLOPS:g}: H100 SXM)")
    p.add_argument("--mfu", type=float, default=DEFAULT_MFU,
                   help=f"model FLOPs utilisation assumed for the step-time estimate (default {DEFAULT_MFU:g})")
    p.add_argument("--fs-write-gbps", type=float, default=DEFAULT_FS_WRITE_GBPS,
                   help=f"aggregate checkpoint write bandwidth in GB/s (default {DEFAULT_FS_WRITE_GBPS:g})")
    p.add_argument("--gen-mfu", type=float, default=DEFAULT_GEN_MFU,
                   help=f"model FLOPs utilisation assumed for generation when suggesting how many ranks generate "
                        f"with rollout.placement=separate (default {DEFAULT_GEN_MFU:g}); --measured replaces both")
    p.add_argument("--measured", default=None, metavar="RUN_DIR",
                   help="a run's output directory: split the ranks by its measured generation and training times "
                        "(its metrics.jsonl and config.yaml) instead of FLOP estimates")
    p.add_argument("--measured-world", type=int, default=None, metavar="N",
                   help="the number of ranks the --measured run used")


_DESCRIPTION = ("Validate CONFIG for nodes x gpus-per-node ranks and estimate the per-GPU memory of the training "
                "and rollout phases (weights, gradients, distributed optimizer, activations at the token budget, "
                "logits, log-prob chunk; colocated engine weights and KV cache; with trainer.offload the rollout "
                "phase with and without it, the pinned host memory per node and the transfer time). Exits 1 when "
                "the layout is invalid or does not fit, naming the term that overflows.")
_EPILOG = "example: mcpo plan configs/qwen3_32b_mcpo.yaml --nodes 4 --gpus-per-node 8 --gpu-mem-gb 80"


def add_parser(subparsers):
    p = subparsers.add_parser("plan", help="check a parallel layout for a cluster shape and estimate GPU memory",
                              description=_DESCRIPTION, epilog=_EPILOG)
    _add_arguments(p)
    return p


def run(args) -> int:
    from mcpo_megatron.config import ConfigError, config_from_args, model_shape

    for key in ("nodes", "gpus_per_node"):
        if getattr(args, key) < 1:
            print(f"mcpo plan: --{key.replace('_', '-')}={getattr(args, key)} must be >= 1", file=sys.stderr)
            return 2
    for key in ("gpu_mem_gb", "host_mem_gb", "offload_gbps"):
        if not getattr(args, key) > 0:
            print(f"mcpo plan: --{key.replace('_', '-')}={getattr(args, key)} must be > 0", file=sys.stderr)
            return 2
    world = args.nodes * args.gpus_per_node
    try:
        cfg = config_from_args(args)
        result = plan(cfg, world, args.gpu_mem_gb, reserve_gib=args.reserve_gb, gpus_per_node=args.gpus_per_node,
                      host_mem_gib=args.host_mem_gb, offload_gbps=args.offload_gbps)
    except ConfigError as e:
        print(f"mcpo plan: layout invalid for {args.nodes} node(s) x {args.gpus_per_node} GPUs: {e}",
              file=sys.stderr)
        return 1
    tp = cfg.parallelism.tensor_model_parallel_size
    pp = cfg.parallelism.pipeline_model_parallel_size
    ep = cfg.parallelism.expert_model_parallel_size
    vpp = cfg.parallelism.virtual_pipeline_model_parallel_size or 1
    cp = cfg.parallelism.context_parallel_size
    train_world = result.train_world_size
    title = (f"{args.nodes} node(s) x {args.gpus_per_node} GPUs x {args.gpu_mem_gb:g} GiB: world {world}, "
             + (f"{train_world} training + {result.rollout_world_size} engine ranks, " if result.separate else "")
             + f"TP={tp} PP={pp}" + (f" CP={cp}" if cp > 1 else "") + f" DP={train_world // (tp * pp * cp)}"
             + (f" EP={ep}" if ep > 1 else "")
             + (f" VPP={vpp}" if vpp > 1 else "") + f", rollout TP={cfg.rollout.tensor_parallel_size}, "
             f"{cfg.trainer.max_tokens_per_microbatch} tokens/micro-batch")
    print(format_plan(result, title))
    train_world = result.train_world_size  # the ranks that train (all of them when colocated)
    try:
        lead = estimate_preempt_lead(model_shape(cfg), cfg, train_world, peak_flops=args.peak_tflops * 1e12,
                                     mfu=args.mfu, fs_write_gbps=args.fs_write_gbps,
                                     engine_world=result.rollout_world_size if result.separate else 0)
    except ValueError as e:
        print(f"mcpo plan: {e}", file=sys.stderr)
        return 2
    print(format_preempt_lead(lead, train_world, args.peak_tflops * 1e12, args.mfu, args.fs_write_gbps))
    if cfg.rollout.placement == "separate" or args.measured:
        try:
            gen_device_s, train_device_s, source = _step_device_seconds(args, cfg, world)
        except (OSError, ValueError, KeyError) as e:
            print(f"mcpo plan: --measured {args.measured}: {e}", file=sys.stderr)
            return 2
        print(format_split(suggest_split(cfg, world, gen_device_s=gen_device_s, train_device_s=train_device_s,
                                         gpus_per_node=args.gpus_per_node), world, source))
    for w in result.warnings:
        print(f"warning: {w}", file=sys.stderr)
    if not result.ok:
        for e in result.errors:
            print(f"mcpo plan: does not fit: {e}", file=sys.stderr)
        return 1
    print("plan OK: fits", file=sys.stderr)
    return 0


def _step_device_seconds(args, cfg, world: int) -> tuple[float, float, str]:
    """Device-seconds of one step's generation and training: measured in ``--measured RUN_DIR`` (means over its
    steps after the first, times the ranks each phase ran on) or estimated from model FLOPs."""
    from mcpo_megatron.config import model_shape, role_world_sizes

    if args.measured is None:
        work = step_work(model_shape(cfg), cfg)
        peak = args.peak_tflops * 1e12
        return (work["generate_flops"] / (peak * args.gen_mfu), work["train_flops"] / (peak * args.mfu),
                f"estimated: full-length responses, generation at MFU {args.gen_mfu:g}, training at {args.mfu:g}")
    from pathlib import Path

    from mcpo_megatron.config import load_config
    from mcpo_megatron.accounting import read_jsonl

    run = Path(args.measured)
    measured_cfg = load_config(str(run / "config.yaml"))
    records = read_jsonl(run / "metrics.jsonl")[1:]  # the first step compiles and warms up
    if not records:
        raise ValueError("needs at least two logged steps")
    run_world = int(args.measured_world or 0) or None
    if run_world is None:
        raise ValueError("pass --measured-world N, the number of ranks that run used")
    train_ranks, engine_ranks = role_world_sizes(measured_cfg, run_world)
    separate = measured_cfg.rollout.placement == "separate"
    gen_key = "time/engine_generate" if separate else "time/rollout"
    mean = lambda key: sum(float(r.get(key, 0.0)) for r in records) / len(records)  # noqa: E731
    train_s = mean("time/old_logprobs") + mean("time/train")
    return (mean(gen_key) * engine_ranks, train_s * train_ranks,
            f"measured: {run} ({len(records)} steps on {run_world} ranks)")
