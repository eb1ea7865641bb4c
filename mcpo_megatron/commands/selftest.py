"""``mcpo selftest``: the first command to run on a new allocation, before a real job.

It checks, in a few minutes and on every rank of the allocation, what a training run relies on, and prints one
table at the end (JSON beside it, ``--json``); the exit status is 1 when a check fails, naming it:

================  =====================================================================================
check             what it measures
================  =====================================================================================
cuda              GPUs seen by every rank (name, count, compute capability); skipped without CUDA
collectives       all-reduce of the training device's tensors across the allocation (exact sum, bus
                  GB/s), and of a CPU flag (the gloo half of the default backend map)
te_layers         Transformer Engine layers vs the local layer spec vs transformers, bf16, a tiny random
                  model (max |log-prob diff|); skipped without CUDA or Transformer Engine
local_spec        the local layer spec at TP vs transformers (fp32 on CPU, bf16 on GPUs)
hybrid_layers     a tiny random Qwen3.5 (Gated DeltaNet, gated attention) at TP vs transformers in float64:
                  flash-linear-attention's kernels in bf16 on GPUs (skipped when not installed), the CPU
                  reference kernels in fp32 on CPU
engine            the rollout engine (vLLM when installed, else the PyTorch engine) after a reshard vs the
                  policy's own log-probs of the sampled tokens: mismatch/k3 and max |diff|
reshard           the weight update into that engine: GB/s
train_step        one training step of a model with random weights: tokens/s and MFU (GPUs of known peak)
memory            peak GPU memory of that step vs ``mcpo plan``'s training-phase estimate; CPU: reported only
batch_invariance  vLLM's batch-invariant mode (``rollout.batch_invariant``) on each rank's GPU: the same
                  seeded requests alone and among others, identical tokens and log-probs (an engine process
                  of its own); skipped without CUDA or vLLM
================  =====================================================================================

Run it like training: ``mcpo selftest`` starts torchrun itself on one machine (``--nproc``: the GPUs, or 2
processes on a CPU machine); under srun every task of the allocation takes part (``slurm/selftest.sbatch``).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import asdict
from pathlib import Path

from mcpo_megatron.commands.selftest_checks import (
    FAIL,
    PASS,
    SKIP,
    CheckResult,
    check_batch_invariance,
    check_collectives,
    check_cuda,
    check_engine,
    check_hybrid_layers,
    check_local_spec,
    check_te_layers,
    check_train_step,
)

__all__ = ["add_parser", "run", "summarize", "selftest_config", "CheckResult", "PASS", "FAIL", "SKIP"]


def summarize(results: list[CheckResult]) -> tuple[int, str]:
    """The exit status (1 when any check failed) and the table, markdown-compatible."""
    lines = ["| check | result | figure | detail |", "|---|---|---|---|"]
    for r in results:
        cells = (r.name, r.status.upper(), r.figure, r.detail)
        lines.append("| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |")
    failed = [r.name for r in results if r.status == FAIL]
    skipped = [r.name for r in results if r.status == SKIP]
    lines.append("")
    if failed:
        lines.append("selftest FAILED: " + ", ".join(failed))
    else:
        lines.append(f"selftest passed ({len(results) - len(skipped)} checks"
                     + (f"; skipped: {', '.join(skipped)}" if skipped else "") + ")")
    return (1 if failed else 0), "\n".join(lines)


# ---------------------------------------------------------------------------------------------- models
def tiny_overrides() -> dict:
    """A tiny random Qwen3 (vocab 256, 4 heads of 32 in 2 KV groups: a head size vLLM's CPU attention has)."""
    return dict(hidden_size=128, num_hidden_layers=4, intermediate_size=256, head_dim=32)


def hybrid_overrides(tp: int) -> dict:
    """The tiny Qwen3.5 of the hybrid check, its Gated DeltaNet heads (2 TP ranks' worth of key heads, two value
    heads to each) divisible by any ``tp``."""
    return dict(linear_num_key_heads=2 * tp, linear_num_value_heads=4 * tp)


def bench_hf_config(cuda: bool):
    """The model of the throughput and memory checks: random weights, so nothing is read from disk. On GPUs a
    Qwen3 layout of about 0.5B parameters (enough work for a meaningful MFU); on CPU the tiny model."""
    from mcpo_megatron.models.tiny import tiny_hf_config

    if not cuda:
        return tiny_hf_config("qwen3", **tiny_overrides())
    return tiny_hf_config("qwen3", vocab_size=32768, hidden_size=1536, intermediate_size=4608, num_hidden_layers=16,
                          num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096)


def probe(vocab: int, batch: int = 4, seq_len: int = 24, seed: int = 0):
    from mcpo_megatron.models.parity import probe_ids

    return probe_ids(vocab, batch, seq_len, seed)


# ---------------------------------------------------------------------------------------------- the command
def selftest_config(model_dir: str, hf_config, *, tp: int, engine: str, world: int):
    """The run config of the checks: ``hf_config``'s shape as model.arch, short sequences, the given engine."""
    from mcpo_megatron.config import load_config

    c = hf_config
    arch = dict(num_layers=c.num_hidden_layers, hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads,
                num_key_value_heads=c.num_key_value_heads, ffn_hidden_size=c.intermediate_size,
                vocab_size=c.vocab_size, head_dim=c.head_dim, max_position_embeddings=c.max_position_embeddings,
                tie_word_embeddings=bool(c.tie_word_embeddings), family="qwen3")
    overrides = [f"model.path={model_dir}", f"parallelism.tensor_model_parallel_size={tp}",
                 f"rollout.engine={engine}", "rollout.tensor_parallel_size=1", "rollout.n=2",
                 "rollout.max_new_tokens=8", "rollout.max_num_seqs=16", "rollout.gpu_memory_utilization=0.3",
                 "data.max_prompt_length=32", "data.max_response_length=8", "data.train_batch_size=2",
                 "algorithm.mini_batch_size=2", "reshard.bucket_mb=16", "trainer.max_tokens_per_microbatch=8192",
                 "trainer.logprob_chunk_size=1024", "optimizer.lr=1e-6", "trainer.total_steps=1"]
    overrides += [f"model.arch.{k}={v}" for k, v in arch.items()]
    return load_config(None, overrides)


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("selftest", help="check a new allocation: GPUs, collectives, layers, engine, a step",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                              epilog="example: mcpo selftest --json selftest.json   (or sbatch slurm/selftest.sbatch)")
    _add_arguments(p)
    return p


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc", type=int, default=None,
                   help="processes to start when not under a launcher (default: this machine's GPUs, else 2)")
    p.add_argument("--json", default="selftest.json", help="where rank 0 writes the results (default selftest.json)")
    p.add_argument("--tp", type=int, default=None,
                   help="tensor-parallel size of the model checks (default 2 when the world size is even, else 1)")
    p.add_argument("--engine", choices=("auto", "vllm", "torch"), default="auto",
                   help="rollout engine of the engine check (auto: vLLM when installed)")
    p.add_argument("--allreduce-mb", type=float, default=None,
                   help="all-reduce size in MiB (default 256 on GPUs, 16 on CPU)")


def run(args) -> int:
    import importlib.util

    import torch

    from mcpo_megatron.parallel.distributed import run_under_torchrun, under_launcher

    if not under_launcher():

        nproc = args.nproc or (torch.cuda.device_count() if torch.cuda.is_available() else 2)
        argv = ["--json", args.json, "--engine", args.engine]
        argv += ["--tp", str(args.tp)] if args.tp else []
        argv += ["--allreduce-mb", str(args.allreduce_mb)] if args.allreduce_mb else []
        return run_under_torchrun(["selftest", *argv], nproc)

    from mcpo_megatron.models.parity import hf_reference_logits
    from mcpo_megatron.models.tiny import make_tiny_hf_model, tiny_hf_config
    from mcpo_megatron.parallel.distributed import (broadcast_object, destroy_distributed, init_distributed,
                                                    launcher_env)

    rank, world, _ = launcher_env()
    cuda = torch.cuda.is_available()
    tp = args.tp or (2 if world % 2 == 0 else 1)
    engine = args.engine if args.engine != "auto" else (
        "vllm" if importlib.util.find_spec("vllm") is not None else "torch")
    work = tempfile.TemporaryDirectory(prefix=f"mcpo-selftest-{rank}-")
    # Every rank writes the same (seeded) tiny model for itself: no shared file system needed.
    tiny_dir = make_tiny_hf_model("qwen3", Path(work.name) / "tiny", seed=0, **tiny_overrides())
    tiny = tiny_hf_config("qwen3", **tiny_overrides())
    ids = probe(tiny.vocab_size)
    ref = hf_reference_logits(tiny_dir, ids)  # before init_distributed: transformers must not see the CPU shim
    hybrid_dir = make_tiny_hf_model("qwen3_5", Path(work.name) / "hybrid", seed=0, **hybrid_overrides(tp))
    hybrid = tiny_hf_config("qwen3_5", **hybrid_overrides(tp))
    hybrid_ref = hf_reference_logits(hybrid_dir, ids, dtype=torch.float64)

    info = init_distributed(tp, 1, seed=0, timeout_s=600.0)
    results: list[CheckResult] = []

    def attempt(name, fn):
        try:
            out = fn()
        except Exception as e:  # a check that raises fails with its message instead of ending the selftest
            out = CheckResult(name, FAIL, "-", f"{type(e).__name__}: {e}")
        results.extend(out if isinstance(out, tuple) else [out])

    try:
        cfg = selftest_config(tiny_dir, tiny, tp=tp, engine=engine, world=world)
        bench = bench_hf_config(cuda)
        bench_cfg = selftest_config(tiny_dir, bench, tp=tp, engine=engine, world=world)
        attempt("cuda", lambda: check_cuda(info))
        attempt("collectives", lambda: check_collectives(info, megabytes=args.allreduce_mb or (256 if cuda else 16)))
        attempt("te_layers", lambda: check_te_layers(info, tiny, tiny_dir, ids, ref))
        attempt("local_spec", lambda: check_local_spec(info, tiny, tiny_dir, ids, ref))
        attempt("hybrid_layers", lambda: check_hybrid_layers(info, hybrid, hybrid_dir, ids, hybrid_ref))
        attempt("train_step", lambda: check_train_step(info, bench_cfg, bench, sequences=8 * info.dp,
                                                        seq_len=2048 if cuda else 128))
        attempt("batch_invariance", lambda: check_batch_invariance(info, tiny_dir, engine))
        # Last: closing vLLM also ends torch.distributed's default group (VLLMRolloutEngine.close).
        attempt("engine", lambda: check_engine(info, cfg, tiny_dir, engine, ids))
        status, table = summarize(results)
        if rank == 0:
            print("\n" + table, flush=True)
            Path(args.json).write_text(json.dumps({"world_size": world, "tp": tp, "engine": engine, "status": status,
                                                   "checks": [asdict(r) for r in results]}, indent=2, default=str))
            print(f"wrote {args.json}", flush=True)
        status = broadcast_object(status, src=0)
    finally:
        destroy_distributed()
        work.cleanup()
    return status
