"""``mcpo selftest``: the first command to run on a new allocation, before a real job.

It checks, in a few minutes and on every rank of the allocation, what a training run relies on, and prints one
table at the end (JSON beside it, ``--json``); the exit status is 1 when a check fails, naming it:

==============  =====================================================================================
check           what it measures
==============  =====================================================================================
cuda            GPUs seen by every rank (name, count, compute capability); skipped without CUDA
collectives     all-reduce of the training device's tensors across the allocation (exact sum, bus
                GB/s), and of a CPU flag (the gloo half of the default backend map)
te_layers       Transformer Engine layers vs the local layer spec vs transformers, bf16, a tiny random
                model (max |log-prob diff|); skipped without CUDA or Transformer Engine
local_spec      the local layer spec at TP vs transformers (fp32 on CPU, bf16 on GPUs)
engine          the rollout engine (vLLM when installed, else the PyTorch engine) after a reshard vs the
                policy's own log-probs of the sampled tokens: mismatch/k3 and max |diff|
reshard         the weight update into that engine: GB/s
train_step      one training step of a model with random weights: tokens/s and MFU (GPUs of known peak)
memory          peak GPU memory of that step vs ``mcpo plan``'s training-phase estimate; CPU: reported only
==============  =====================================================================================

Run it like training: ``mcpo selftest`` starts torchrun itself on one machine (``--nproc``: the GPUs, or 2
processes on a CPU machine); under srun every task of the allocation takes part (``slurm/selftest.sbatch``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

PASS, FAIL, SKIP = "pass", "fail", "skip"
# Dense bf16 peaks (FLOP/s) of GPUs whose MFU the train_step check reports, by a substring of the device name.
GPU_PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "H20": 148e12, "A100": 312e12, "B200": 2250e12, "L40S": 362e12}
# Tolerances on max |log-prob diff|.
FP32_TOL = 1e-4
BF16_TOL = 0.15       # bf16 rounding of a tiny random model: log-probs move by ~1e-2
BF16_K3_TOL = 1e-3    # engine vs trainer k3 in bf16 (an MoE routing flip or a stale weight is far above)
MEMORY_SLACK = 1.25   # measured peak may exceed the plan's estimate by this factor before the check fails


@dataclass
class CheckResult:
    """One row of the table: ``status`` pass | fail | skip, the headline ``figure`` and what it means."""

    name: str
    status: str
    figure: str
    detail: str
    data: dict = field(default_factory=dict)


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


def bench_hf_config(cuda: bool):
    """The model of the throughput and memory checks: random weights, so nothing is read from disk. On GPUs a
    Qwen3 layout of about 0.5B parameters (enough work for a meaningful MFU); on CPU the tiny model."""
    from mcpo_megatron.models.sources import tiny_hf_config

    if not cuda:
        return tiny_hf_config("qwen3", **tiny_overrides())
    return tiny_hf_config("qwen3", vocab_size=32768, hidden_size=1536, intermediate_size=4608, num_hidden_layers=16,
                          num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096)


def probe(vocab: int, batch: int = 4, seq_len: int = 24, seed: int = 0):
    from mcpo_megatron.models.parity import probe_ids

    return probe_ids(vocab, batch, seq_len, seed)


# ---------------------------------------------------------------------------------------------- checks
def check_cuda(info) -> CheckResult:
    """The GPU of every rank: fails when two ranks share one. A GPU is known by its UUID, not its index: under a
    binding of one GPU per task every rank's device is index 0 of its own set."""
    import torch

    from mcpo_megatron.parallel.distributed import all_gather_objects

    if info.device.type != "cuda":
        return CheckResult("cuda", SKIP, "-", "no CUDA on this machine (CPU subset: gloo, local spec, engine)")
    props = torch.cuda.get_device_properties(info.device)
    mine = (os.uname().nodename, info.device.index, str(props.uuid), os.environ.get("CUDA_VISIBLE_DEVICES"),
            props.name, f"{props.major}.{props.minor}", round(props.total_memory / 2**30, 1))
    seen = all_gather_objects(mine)
    ranks_of: dict[str, list[int]] = {}
    for rank, (_, _, uuid, *_) in enumerate(seen):
        ranks_of.setdefault(uuid, []).append(rank)
    nodes = {s[0] for s in seen}
    names = sorted({s[4] for s in seen})
    data = {"ranks": [dict(zip(("node", "device", "uuid", "visible_devices", "name", "capability", "memory_gib"), s))
                      for s in seen]}
    shared = [f"ranks {', '.join(map(str, ranks))} share GPU {uuid} on {seen[ranks[0]][0]}"
              for uuid, ranks in ranks_of.items() if len(ranks) > 1]
    if shared:
        return CheckResult("cuda", FAIL, f"{len(seen)} ranks", "; ".join(shared) + ": one rank per GPU (check "
                           "--ntasks-per-node against the GPUs per node, and the GPU binding)", data)
    return CheckResult("cuda", PASS, f"{len(seen)} x {', '.join(names)}",
                       f"{len(nodes)} node(s), compute capability {mine[5]}, {mine[6]} GiB each", data)


def check_collectives(info, *, megabytes: float) -> CheckResult:
    """All-reduce of the training device's tensors (exact sum, bus bandwidth) and of a CPU flag."""
    import torch

    from mcpo_megatron.parallel.distributed import all_reduce_max, all_reduce_sum, barrier, default_backend

    n = info.world_size
    if n == 1:
        return CheckResult("collectives", SKIP, "-", "one rank: nothing to reduce")
    numel = int(megabytes * 2**20 // 4)
    x = torch.full((numel,), float(info.rank + 1), dtype=torch.float32, device=info.device)
    all_reduce_sum(x)  # warm-up, and the exact-sum check: 1 + ... + n
    exact = bool((x == n * (n + 1) / 2).all())
    times = []
    for _ in range(5):
        barrier()
        _sync(info)
        t0 = time.perf_counter()
        all_reduce_sum(x)
        _sync(info)
        times.append(time.perf_counter() - t0)
    seconds = sorted(times)[len(times) // 2]
    bus_gbps = numel * 4 * 2 * (n - 1) / n / seconds / 1e9  # nccl-tests' bus bandwidth of an all-reduce
    flag = all_reduce_max(torch.tensor([info.rank], dtype=torch.int32))  # a CPU tensor, whatever the device
    flag_ok = int(flag.item()) == n - 1
    backend = default_backend(info.device.type == "cuda")
    data = {"ranks": n, "megabytes": megabytes, "seconds": seconds, "bus_gbps": bus_gbps, "exact": exact,
            "cpu_flag_ok": flag_ok, "backend": backend}
    ok = exact and flag_ok
    detail = (f"{megabytes:g} MiB fp32 on {info.device.type} over {n} ranks ({backend}); CPU flag "
              + ("ok" if flag_ok else "WRONG") + ("" if exact else "; the sum was WRONG"))
    return CheckResult("collectives", PASS if ok else FAIL, f"{bus_gbps:.2f} GB/s bus", detail, data)


def _sync(info) -> None:
    import torch

    if info.device.type == "cuda":
        torch.cuda.synchronize()


def logprob_diff(ours, ref, ids) -> float:
    from mcpo_megatron.models.parity import logit_stats

    return logit_stats(ours, ref, ids)["max_abs_logprob_diff"]


def spec_logits(hf_config, hf_dir: str, ids, *, dtype, impl: str):
    """Full-vocabulary logits of ``ids`` from the Megatron model (layer spec ``impl``) on the last stage."""
    from mcpo_megatron.models.builder import build_model_chunks
    from mcpo_megatron.models.parity import megatron_logits
    from mcpo_megatron.models.hf_io import load_hf_weights
    from mcpo_megatron.parallel.distributed import all_gather_objects

    chunks = build_model_chunks(hf_config, dtype=dtype, transformer_impl=impl,
                                config_overrides={"perform_initialization": False})
    load_hf_weights(chunks, hf_dir)
    logits = megatron_logits(chunks, ids)
    from megatron.core import parallel_state as ps

    keep = ps.is_pipeline_last_stage(ignore_virtual=True) and ps.get_tensor_model_parallel_rank() == 0
    gathered = all_gather_objects(logits if keep else None)
    return next(t for t in gathered if t is not None)


def check_local_spec(info, hf_config, hf_dir, ids, ref) -> CheckResult:
    import torch

    gpu = info.device.type == "cuda"
    dtype, tol = (torch.bfloat16, BF16_TOL) if gpu else (torch.float32, FP32_TOL)
    diff = logprob_diff(spec_logits(hf_config, hf_dir, ids, dtype=dtype, impl="local"), ref, ids)
    name = "bf16" if gpu else "fp32"
    return CheckResult("local_spec", PASS if diff <= tol else FAIL, f"max abs dlogp {diff:.2e}",
                       f"local layer spec at TP={info.tp} vs transformers fp32, {name} (tolerance {tol:g})",
                       {"max_abs_logprob_diff": diff, "dtype": name, "tolerance": tol, "tp": info.tp})


def check_te_layers(info, hf_config, hf_dir, ids, ref) -> CheckResult:
    import torch

    if info.device.type != "cuda":
        return CheckResult("te_layers", SKIP, "-", "Transformer Engine needs CUDA")
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return CheckResult("te_layers", SKIP, "-", "transformer-engine is not installed (pip install -e '.[gpu]')")
    te = spec_logits(hf_config, hf_dir, ids, dtype=torch.bfloat16, impl="transformer_engine")
    local = spec_logits(hf_config, hf_dir, ids, dtype=torch.bfloat16, impl="local")
    vs_hf, vs_local = logprob_diff(te, ref, ids), logprob_diff(te, local, ids)
    ok = vs_hf <= BF16_TOL and vs_local <= BF16_TOL
    return CheckResult("te_layers", PASS if ok else FAIL, f"max abs dlogp {vs_hf:.2e}",
                       f"TE spec bf16 vs transformers fp32; vs the local spec bf16: {vs_local:.2e} "
                       f"(tolerance {BF16_TOL:g})", {"vs_transformers": vs_hf, "vs_local": vs_local})


def check_engine(info, cfg, hf_dir: str, engine_name: str, ids) -> tuple[CheckResult, CheckResult]:
    """Reshard the policy into the engine, generate, compare (the rollout contract), and time the reshard."""
    import torch

    from mcpo_megatron.rollout.contract import policy_contract_figures
    from mcpo_megatron.rollout.engine import SamplingParams, generate_data_parallel
    from mcpo_megatron.rollout.reshard import Resharder
    from mcpo_megatron.trainer.components import build_engine, build_policy, torch_dtype

    policy = build_policy(cfg, hf_dir, info)
    engine = build_engine(cfg, hf_dir, policy.hf_config, None, info)
    try:
        resharder = Resharder(policy.model_chunks, policy.hf_config, bucket_mb=cfg.reshard.bucket_mb,
                              parallel_info=info)
        stats = resharder.push(engine)
        prompts = [row[:8].tolist() for row in ids]
        sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=cfg.rollout.max_new_tokens, seed=0)
        out = generate_data_parallel(engine, prompts, sampling, rollout_tp=cfg.rollout.tensor_parallel_size)
        figures = policy_contract_figures(policy, prompts, out)
    finally:
        engine.close()
    bf16 = torch_dtype(cfg, info.device) == torch.bfloat16
    if bf16:
        ok, rule = figures["k3_kl"] <= BF16_K3_TOL, f"bf16: k3 <= {BF16_K3_TOL:g}"
    else:
        ok, rule = figures["max_abs_diff"] <= FP32_TOL, f"fp32: max abs diff <= {FP32_TOL:g}"
    engine_row = CheckResult(
        "engine", PASS if ok else FAIL, f"k3 {figures['k3_kl']:.2e}, max {figures['max_abs_diff']:.2e}",
        f"{engine_name} engine (rollout TP={cfg.rollout.tensor_parallel_size}) vs the policy after a reshard, "
        f"{figures['tokens']} sampled tokens ({rule})", figures)
    reshard_row = CheckResult("reshard", PASS, f"{stats.gbps:.2f} GB/s",
                              f"{stats.bytes / 1e6:.1f} MB in {stats.buckets} buckets, {stats.seconds:.3f} s",
                              asdict(stats))
    return engine_row, reshard_row


def check_train_step(info, cfg, hf_config, *, sequences: int, seq_len: int) -> tuple[CheckResult, CheckResult]:
    """One optimizer step of a random-weight model on random tokens: tokens/s, MFU, peak memory vs the plan."""
    import torch

    from mcpo_megatron import accounting
    from mcpo_megatron.algorithms import losses
    from mcpo_megatron.config import model_shape as config_shape
    from mcpo_megatron.models.batch import SequenceBatch
    from mcpo_megatron.planner import estimate_training_memory, param_counts
    from mcpo_megatron.trainer.components import build_policy

    policy = build_policy(cfg, None, info, hf_config, load_weights=False)
    gen = torch.Generator().manual_seed(info.dp_rank)
    prompt = seq_len // 4
    mine = max(1, sequences // info.dp)
    ids = [torch.randint(0, hf_config.vocab_size, (seq_len,), generator=gen) for _ in range(mine)]
    batch = SequenceBatch(input_ids=ids, prompt_lens=torch.full((mine,), prompt),
                          response_lens=torch.full((mine,), seq_len - prompt))
    old, _ = policy.compute_logprobs(batch, compute_entropy=False)
    total_tokens = mine * info.dp * (seq_len - prompt)
    batch.token_fields.update(
        old_logp=old, advantages=[torch.full((seq_len - prompt,), 1.0 if i % 2 else -1.0) for i in range(mine)],
        pg_weight=[torch.full((seq_len - prompt,), 1.0 / total_tokens) for _ in range(mine)])

    def loss_fn(logp, entropy, mb):
        f = mb.token_fields
        return losses.policy_loss(logp, f["old_logp"], f["advantages"], f["pg_weight"], mb.mask)

    policy.train_step(batch, loss_fn)  # warm-up (allocations, kernels)
    if info.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    _sync(info)
    t0 = time.perf_counter()
    out = policy.train_step(batch, loss_fn)
    _sync(info)
    seconds = time.perf_counter() - t0
    flops = accounting.model_flops(config_shape(cfg), kind="train", prompt_lens=prompt, response_lens=seq_len - prompt,
                                   num_sequences=mine * info.dp)
    tokens_per_s = mine * info.dp * seq_len / seconds
    data = {"seconds": seconds, "tokens_per_s": tokens_per_s, "flops": flops, "grad_norm": out["grad_norm"],
            "params": param_counts(config_shape(cfg), 1, 1)["total"]}
    peak = _peak_flops(info)
    if peak is not None:
        data["mfu"] = flops / seconds / (info.world_size * peak)
        figure = f"{tokens_per_s:,.0f} tok/s, MFU {100 * data['mfu']:.1f}%"
    else:
        figure = f"{tokens_per_s:,.0f} tok/s"
    finite = math.isfinite(out["grad_norm"]) and out["skipped"] == 0.0
    step_row = CheckResult("train_step", PASS if finite else FAIL, figure,
                           f"{data['params'] / 1e6:,.1f}M params, {mine * info.dp} x {seq_len} tokens, TP={info.tp} "
                           f"DP={info.dp}" + ("" if peak is not None else "; MFU needs a GPU of known peak")
                           + ("" if finite else "; the gradient was NOT finite"), data)

    peak_bytes = accounting.peak_memory_bytes(all_ranks=True)
    planned = step_plan_config(cfg, prompt, seq_len - prompt)
    estimate = sum(t.bytes for t in estimate_training_memory(config_shape(planned), planned, info.world_size).values())
    mem = {"peak_bytes": peak_bytes, "plan_bytes": estimate}
    if info.device.type != "cuda":
        mem_row = CheckResult("memory", SKIP, f"{peak_bytes / 2**30:.2f} GiB RSS",
                              f"the plan models GPU memory ({estimate / 2**30:.3f} GiB here); on CPU the process RSS "
                              "includes the interpreter and libraries", mem)
    else:
        ok = peak_bytes <= MEMORY_SLACK * estimate
        mem_row = CheckResult("memory", PASS if ok else FAIL,
                              f"{peak_bytes / 2**30:.2f} of {estimate / 2**30:.2f} GiB planned",
                              f"peak allocated in the step vs mcpo plan's training phase (fails above "
                              f"{MEMORY_SLACK:g}x: the plan would under-provision)", mem)
    return step_row, mem_row


def _peak_flops(info) -> float | None:
    import torch

    if info.device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(info.device)
    return next((peak for key, peak in GPU_PEAK_FLOPS.items() if key in name), None)


# ---------------------------------------------------------------------------------------------- the command
def step_plan_config(cfg, prompt_len: int, response_len: int):
    """``cfg`` as ``mcpo plan`` must see the train-step check: its sequence lengths (not the engine check's short
    ones) and the layer implementation the step really ran (``auto`` is planned as Transformer Engine, whose fused
    attention keeps no score matrix; without it megatron's local attention does)."""
    from omegaconf import OmegaConf

    from mcpo_megatron.models.megatron_config import resolve_impl

    planned = OmegaConf.merge(cfg, {"data": {"max_prompt_length": prompt_len, "max_response_length": response_len},
                                    "model": {"transformer_impl": resolve_impl(cfg.model.transformer_impl)}})
    return planned


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
    from mcpo_megatron.models.sources import make_tiny_hf_model, tiny_hf_config
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
        attempt("train_step", lambda: check_train_step(info, bench_cfg, bench, sequences=8 * info.dp,
                                                        seq_len=2048 if cuda else 128))
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

