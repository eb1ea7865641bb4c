"""``mcpo check-rollout``: the engine / trainer numerics contract, end to end.

Builds the Megatron policy at TP x PP, reshards its weights into the rollout
engine, generates, recomputes the same tokens' log-probs with the policy at the
same temperature, and prints max / mean |diff| and the mean k3 KL(engine ||
trainer).  Exits 1 when the max |diff| is beyond the tolerance (default 1e-4 in
float32; reported only otherwise).

The comparison uses temperature sampling without top-p / top-k: the trainer's
log-probs are those of the temperature-scaled full distribution, which is the
engine's processed distribution only when nothing is truncated.

Run it under torchrun with ``tp * pp * ep`` (or a multiple) processes::

    torchrun --nproc_per_node 2 -m mcpo_megatron.cli check-rollout --model builtin:smollm2-135m-instruct \\
        --tp 2 --pp 1 --rollout-tp 1
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from mcpo_megatron.rollout.engines.contract import policy_contract_figures

DEFAULT_PROMPTS = [
    "What is 7 + 5? Answer with just the number.",
    "Name a prime number larger than ten.",
    "The capital of France is",
    "def fibonacci(n):",
]


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "check-rollout",
        help="check the rollout engine and weight resharding against the Megatron policy",
        description="Reshard the Megatron policy (TP x PP) into the rollout engine, generate, and compare the "
                    "engine's log-probs with the policy's recomputation (max/mean |diff|, k3 KL). "
                    "Multi-process layouts run under torchrun; without torchrun the command to use is printed.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", required=True, help="HF directory or builtin:<name> (e.g. builtin:smollm2-135m-instruct)")
    p.add_argument("--tp", type=int, default=1, help="training tensor-parallel size")
    p.add_argument("--pp", type=int, default=1, help="training pipeline-parallel size")
    p.add_argument("--ep", type=int, default=1,
                   help="training expert-parallel size (MoE models; experts split over data-parallel ranks)")
    p.add_argument("--sequence-parallel", action="store_true", help="training sequence parallelism (TP > 1)")
    p.add_argument("--rollout-tp", type=int, default=1, help="rollout engine tensor-parallel size")
    p.add_argument("--engine", choices=("torch", "vllm"), default="torch", help="rollout engine")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="policy and engine dtype")
    p.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (> 0)")
    p.add_argument("--max-new-tokens", type=int, default=16, help="response length cap")
    p.add_argument("--samples", type=int, default=2, help="samples per prompt")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--prompts", nargs="+", default=None,
                   help="prompt texts (tokenized with the model's tokenizer); default: a few built-in ones")
    p.add_argument("--prompt-ids", default=None,
                   help="prompts as token ids instead of text, e.g. '1,2,3;4,5' (models without a tokenizer)")
    p.add_argument("--bucket-mb", type=float, default=64, help="reshard bucket size in MiB")
    p.add_argument("--tolerance", type=float, default=None,
                   help="fail when max |diff| exceeds it (default 1e-4 for float32, not checked for bfloat16)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3, help="vLLM only")
    p.add_argument("--json", default=None, help="also write the figures to this JSON file (rank 0)")
    return p


def torchrun_command(args: argparse.Namespace) -> str:
    """The torchrun command line that runs these arguments with one process per rank."""
    import shlex

    nproc = max(args.tp * args.pp * args.ep, args.rollout_tp)
    parts = ["check-rollout", "--model", args.model, "--tp", args.tp, "--pp", args.pp, "--ep", args.ep,
             "--rollout-tp", args.rollout_tp, "--engine", args.engine, "--dtype", args.dtype,
             "--temperature", args.temperature, "--max-new-tokens", args.max_new_tokens, "--samples", args.samples,
             "--seed", args.seed, "--bucket-mb", args.bucket_mb]
    if args.sequence_parallel:
        parts += ["--sequence-parallel"]
    if args.prompts:
        parts += ["--prompts", *args.prompts]
    for flag, value in (("--prompt-ids", args.prompt_ids), ("--tolerance", args.tolerance),
                        ("--json", args.json)):
        if value is not None:
            parts += [flag, value]
    return f"torchrun --nproc_per_node {nproc} -m mcpo_megatron.cli " + " ".join(shlex.quote(str(p)) for p in parts)


def parse_prompt_ids(text: str) -> list[list[int]]:
    try:
        prompts = [[int(t) for t in part.split(",") if t.strip()] for part in text.split(";") if part.strip()]
    except ValueError:
        raise ValueError(f"--prompt-ids={text!r} must look like '1,2,3;4,5' (token ids, ';' between prompts)")
    if not prompts or any(not p for p in prompts):
        raise ValueError(f"--prompt-ids={text!r} has an empty prompt")
    return prompts


def run(args: argparse.Namespace) -> int:
    if args.tp < 1 or args.pp < 1 or args.ep < 1 or args.rollout_tp < 1:
        print("check-rollout: --tp, --pp, --ep and --rollout-tp must be >= 1", file=sys.stderr)
        return 2
    if not args.temperature > 0:
        print(f"check-rollout: --temperature={args.temperature} must be > 0", file=sys.stderr)
        return 2
    from mcpo_megatron.parallel.distributed import under_launcher

    if not under_launcher() and max(args.tp * args.pp * args.ep, args.rollout_tp) > 1:
        print("check-rollout needs one process per rank; run it under torchrun:\n  " + torchrun_command(args),
              file=sys.stderr)
        return 2
    try:
        figures = _check(args)
    except ValueError as e:
        print(f"check-rollout: {e}", file=sys.stderr)
        return 2
    return 0 if figures["passed"] else 1


def _check(args: argparse.Namespace) -> dict:
    import torch

    from mcpo_megatron.models.policy import MegatronPolicy
    from mcpo_megatron.models.policy_settings import PolicySettings
    from mcpo_megatron.models.sources import resolve_model_path
    from mcpo_megatron.parallel.distributed import barrier, destroy_distributed, init_distributed
    from mcpo_megatron.rollout.engines.interface import SamplingParams, generate_data_parallel
    from mcpo_megatron.rollout.weights.resharder import Resharder

    info = init_distributed(args.tp, args.pp, ep=args.ep, seed=args.seed)
    engine = None
    if info.world_size % args.rollout_tp != 0:
        raise ValueError(f"--rollout-tp={args.rollout_tp} must divide the world size {info.world_size}")
    dtype = torch.float32 if args.dtype == "float32" else torch.bfloat16
    tolerance = args.tolerance if args.tolerance is not None else (1e-4 if dtype == torch.float32 else math.inf)
    rank0 = info.rank == 0
    try:
        hf_dir = resolve_model_path(args.model) if rank0 else None
        barrier()
        hf_dir = resolve_model_path(args.model)
        from mcpo_megatron.models.multimodal import load_language_model_config

        # MoE with the PyTorch engine: the engine reports its routing, the trainer measures how often its own
        # differs and scores the samples with and without it replayed (R3)
        routing = args.engine == "torch" and bool(getattr(load_language_model_config(hf_dir), "num_experts", 0))
        settings = PolicySettings(dtype=dtype, temperature=args.temperature, sequence_parallel=args.sequence_parallel,
                                  moe_routing_replay="r3" if routing else "off")
        policy = MegatronPolicy(hf_dir, settings, parallel_info=info)
        hf_config = policy.hf_config

        prompts = _prompts(args, hf_dir)
        engine = _build_engine(args, hf_dir, hf_config, info, dtype, prompts, routing=routing)
        resharder = Resharder(policy.model_chunks, hf_config, bucket_mb=args.bucket_mb, parallel_info=info,
                              dtype=dtype)
        sampling = SamplingParams(n=args.samples, temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                                  seed=args.seed)
        # The weight update the trainer makes (the compiled plan where the engine takes it) over the engine's
        # random weights, then the reference, the HF stream: the same weights bit for bit give the same samples.
        stats = resharder.push(engine)
        out = generate_data_parallel(engine, prompts, sampling, rollout_tp=args.rollout_tp)
        resharder.push(engine, stream=True)
        by_stream = generate_data_parallel(engine, prompts, sampling, rollout_tp=args.rollout_tp)

        figures = _figures(args, policy_contract_figures(policy, prompts, out), hf_config, out, stats, tolerance)
        figures.update(_same_samples(out, by_stream), weight_update=stats.path,
                       weight_update_collectives=stats.collectives)
        figures["passed"] = figures["passed"] and figures["same_as_stream"]
        if rank0:
            _print(figures, stats)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(figures, f, indent=2)
        return figures
    finally:
        if engine is not None:
            engine.close()
        destroy_distributed()


def _same_samples(out, reference) -> dict:
    """Whether two generations with the same seeds gave the same tokens, and their log-probs' largest difference
    (0 when the engine's weights were the same bit for bit)."""
    same_tokens = out.token_ids == reference.token_ids
    diff = max((abs(a - b) for x, y in zip(out.logprobs, reference.logprobs) for a, b in zip(x, y)), default=0.0)
    return {"same_as_stream": bool(same_tokens and diff == 0.0), "stream_max_abs_diff": float(diff)}


def _prompts(args: argparse.Namespace, hf_dir: str) -> list[list[int]]:
    """The prompts' token ids: given with --prompt-ids, else --prompts (or the defaults) through the tokenizer."""
    if args.prompt_ids:
        return parse_prompt_ids(args.prompt_ids)
    from mcpo_megatron.models.sources import load_tokenizer

    tok = load_tokenizer(hf_dir, remedy="give the prompts as token ids with --prompt-ids '1,2,3;4,5'")
    return [tok(text).input_ids for text in (args.prompts or DEFAULT_PROMPTS)]


def _build_engine(args: argparse.Namespace, hf_dir: str, hf_config, info, dtype, prompts: list[list[int]], *,
                  routing: bool):
    """The engine under test, with random weights for the reshard to overwrite."""
    if args.engine == "torch":
        from mcpo_megatron.rollout.engines.torch.engine import TorchRolloutEngine

        return TorchRolloutEngine(hf_config, dtype=dtype, device=info.device, return_routed_experts=routing)
    from mcpo_megatron.rollout.engines.vllm.engine import VLLMRolloutEngine

    eos = getattr(hf_config, "eos_token_id", None)
    eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    # Dummy (random) initial weights: the reshard below must overwrite every tensor.
    return VLLMRolloutEngine(hf_dir, eos_token_ids=eos_ids,
                             rollout_tp=args.rollout_tp, dtype=args.dtype, seed=args.seed,
                             gpu_memory_utilization=args.gpu_memory_utilization, load_format="dummy",
                             # whole 128-token KV blocks (allocated per block anyway)
                             max_model_len=-(-(max(len(p) for p in prompts) + args.max_new_tokens) // 128) * 128,
                             max_num_seqs=len(prompts) * args.samples)


def _figures(args: argparse.Namespace, figures: dict, hf_config, out, stats, tolerance: float) -> dict:
    """The contract's figures with the run's settings, the reshard's and the verdict."""
    figures.update(moe=bool(getattr(hf_config, "num_experts", 0)), engine=args.engine)
    figures.update(model=args.model, tp=args.tp, pp=args.pp, ep=args.ep, sequence_parallel=args.sequence_parallel,
                   rollout_tp=args.rollout_tp, dtype=args.dtype,
                   temperature=args.temperature, samples=len(out), tolerance=tolerance,
                   reshard_seconds=stats.seconds, reshard_gbps=stats.gbps, reshard_bytes=stats.bytes,
                   finish_stop=out.finish_reasons.count("stop"))
    figures["passed"] = bool(figures["max_abs_diff"] <= tolerance)
    return figures


def _print(f: dict, stats) -> None:
    print(f"check-rollout: {f['model']}  TP={f['tp']}{' (SP)' if f['sequence_parallel'] else ''} PP={f['pp']} "
          f"EP={f['ep']} -> rollout TP={f['rollout_tp']}  "
          f"{f['dtype']}  T={f['temperature']}")
    print(f"  {stats}")
    print(f"  weight update ({f['weight_update']}) vs the HF stream: "
          f"{'the same samples' if f['same_as_stream'] else 'DIFFERENT samples'} "
          f"(max |dlogp| {f['stream_max_abs_diff']:.1e})")
    print(f"  samples {f['samples']} ({f['finish_stop']} stopped), response tokens {f['tokens']}")
    print(f"  max |diff|   {f['max_abs_diff']:.3e}")
    print(f"  mean |diff|  {f['mean_abs_diff']:.3e}")
    print(f"  k3 KL(engine||trainer) {f['k3_kl']:.3e}")
    if "routing_mismatch" in f:
        print(f"  routing mismatch {f['routing_mismatch']:.2%} of (token, layer) decisions; with the engine's "
              f"routing replayed: max |diff| {f['replay_max_abs_diff']:.3e}, mean |diff| "
              f"{f['replay_mean_abs_diff']:.3e}, k3 KL {f['replay_k3_kl']:.3e}")
    elif f.get("moe"):
        print(f"  routing mismatch: not measured (the {f['engine']} engine does not report its routing)")
    verdict = "PASS" if f["passed"] else "FAIL"
    tol = "not checked" if math.isinf(f["tolerance"]) else f"tolerance {f['tolerance']:.0e}"
    print(f"  {verdict} ({tol})")
