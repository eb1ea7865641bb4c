"""The checks of ``mcpo selftest`` (the command and its table: :mod:`~mcpo_megatron.commands.selftest`). Each
returns :class:`CheckResult` rows; every rank calls each check, which makes the same collective calls on every
rank."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

PASS, FAIL, SKIP = "pass", "fail", "skip"
# Dense bf16 peaks (FLOP/s) of GPUs whose MFU the train_step check reports, by a substring of the device name.
GPU_PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "H20": 148e12, "A100": 312e12, "B200": 2250e12, "L40S": 362e12}
# Tolerances on max |log-prob diff|.
FP32_TOL = 1e-4
# fp32 Gated DeltaNet layers against transformers in float64: the chunked delta rule amplifies fp32 rounding
# (1e-4 to 2e-4 on the logits of a tiny random Qwen3.5, tests/models/test_hybrid_parity_mp.py); a wrong kernel or
# mapping moves log-probs by O(1)
HYBRID_FP32_TOL = 1e-3
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


def check_hybrid_layers(info, hf_config, hf_dir, ids, ref) -> CheckResult:
    """A tiny random Qwen3.5 (Gated DeltaNet and gated attention layers) at TP against transformers in float64:
    on GPUs in bf16 through flash-linear-attention's Triton kernels (the ``gpu`` extra), on CPU in fp32 through
    the plain-torch references the CPU support code binds in their place."""
    import importlib.util

    import torch

    gpu = info.device.type == "cuda"
    if gpu and importlib.util.find_spec("fla") is None:
        return CheckResult("hybrid_layers", SKIP, "-", "flash-linear-attention is not installed: Qwen3.5 and "
                           "Qwen3-Next need its kernels on GPUs (pip install -e '.[gpu]')")
    dtype, tol, name = ((torch.bfloat16, BF16_TOL, "bf16, flash-linear-attention") if gpu
                        else (torch.float32, HYBRID_FP32_TOL, "fp32, the CPU reference kernels"))
    diff = logprob_diff(spec_logits(hf_config, hf_dir, ids, dtype=dtype, impl="local"), ref, ids)
    return CheckResult("hybrid_layers", PASS if diff <= tol else FAIL, f"max abs dlogp {diff:.2e}",
                       f"Qwen3.5 (Gated DeltaNet) at TP={info.tp} vs transformers float64, {name} (tolerance {tol:g})",
                       {"max_abs_logprob_diff": diff, "dtype": str(dtype).replace("torch.", ""), "tolerance": tol,
                        "tp": info.tp})


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

    from mcpo_megatron.rollout.engines.contract import policy_contract_figures
    from mcpo_megatron.rollout.engines.interface import SamplingParams, generate_data_parallel
    from mcpo_megatron.rollout.weights.resharder import Resharder
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


# The batch-invariance check: probe prompts generated alone, then again behind prompts of other lengths (another
# batch size and token count each step, other GEMM shapes and CUDA-graph sizes).
INVARIANCE_PROBES = [[11, 12, 13, 14, 15, 16, 17, 18], [40, 41, 42]]
INVARIANCE_OTHERS = [[(7 * k + j) % 250 + 3 for j in range(length)] for k, length in enumerate((5, 61, 17, 33, 2, 47))]
INVARIANCE_MAIN = ("import sys; from mcpo_megatron.commands.selftest_invariance import main; "
                   "sys.exit(main(sys.argv[1:]))")
# A launcher's variables, which the engine process of the check must not see: it is a standalone engine.
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
                 "MASTER_PORT", "TORCHELASTIC_RUN_ID", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")


def check_batch_invariance(info, hf_dir: str, engine_name: str, *, timeout_s: float = 900.0) -> CheckResult:
    """vLLM's batch-invariant mode (``rollout.batch_invariant``) on this rank's GPU: the same requests generated
    alone and among others give the same tokens and log-probs, bit for bit (:func:`batch_composition_figures`).
    The engine runs in a process of its own (``commands/selftest_invariance.py``, a standalone engine on this
    rank's GPU), since the mode is process-wide and read when vLLM starts, and this process builds the engine of
    the ``engine`` check without it."""
    if info.device.type != "cuda":
        return CheckResult("batch_invariance", SKIP, "-", "needs CUDA: vLLM's batch-invariant mode is a GPU mode (on "
                           "CPU the engine's samples do not depend on the batch: tests/rollout/engines/test_vllm_cpu.py)")
    if engine_name != "vllm":
        return CheckResult("batch_invariance", SKIP, "-", "needs vLLM (rollout.batch_invariant is vLLM's mode)")
    with tempfile.TemporaryDirectory(prefix="mcpo-invariance-") as work:
        out = Path(work) / "figures.json"
        proc = subprocess.run([sys.executable, "-c", INVARIANCE_MAIN, hf_dir, str(out)], env=invariance_env(info),
                              capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0 or not out.is_file():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            return CheckResult("batch_invariance", FAIL, "-", f"the engine process exited with {proc.returncode}: "
                               + " / ".join(tail))
        figures = json.loads(out.read_text())
    return invariance_row(figures)


def invariance_env(info) -> dict[str, str]:
    """The environment of the check's engine process: this rank's GPU only (by its entry in the launcher's
    ``CUDA_VISIBLE_DEVICES``, or its index), no launcher variables, and the mode on from the process's start."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    index = info.device.index or 0
    env["CUDA_VISIBLE_DEVICES"] = visible.split(",")[index].strip() if visible else str(index)
    env["VLLM_BATCH_INVARIANT"] = "1"
    return env


def batch_composition_figures(engine, probes, others, sampling) -> dict:
    """Generate ``probes`` alone, then behind ``others`` in one batch, with the same seeds (each probe keeps its
    prompt index), and compare each probe's samples: how many differ in a token, and the largest |log-prob
    difference| before the first differing token."""
    alone = engine.generate(probes, sampling, prompt_indices=list(range(len(probes))))
    mixed = engine.generate(list(others) + list(probes), sampling,
                            prompt_indices=[len(probes) + k for k in range(len(others))] + list(range(len(probes))))
    batched = {(s.prompt_index, s.sample_index): s for s in mixed.samples}
    differ, worst, first, tokens = 0, 0.0, None, 0
    for a in alone.samples:
        b = batched[(a.prompt_index, a.sample_index)]
        same = 0
        while same < min(len(a.token_ids), len(b.token_ids)) and a.token_ids[same] == b.token_ids[same]:
            same += 1
        tokens += len(a.token_ids)
        worst = max([worst] + [abs(x - y) for x, y in zip(a.logprobs[:same], b.logprobs[:same])])
        if a.token_ids != b.token_ids:
            differ += 1
            first = first or f"prompt {a.prompt_index} sample {a.sample_index} at token {same}"
    return {"samples": len(alone.samples), "tokens": tokens, "differing_samples": differ,
            "max_abs_logprob_diff": worst, "first_difference": first,
            "requests": [len(alone.samples), len(mixed.samples)]}


def invariance_row(figures: dict) -> CheckResult:
    """The batch_invariance row: passes when every probe sample is the same token for token and bit for bit."""
    n, alone, mixed = figures["samples"], *figures["requests"]
    detail = (f"{n} samples ({figures['tokens']} tokens) generated in a batch of {alone} requests and of {mixed}, "
              "VLLM_BATCH_INVARIANT=1, bf16: tokens and log-probs must be identical")
    if figures["differing_samples"] == 0 and figures["max_abs_logprob_diff"] == 0.0:
        return CheckResult("batch_invariance", PASS, f"{n} of {n} identical", detail, figures)
    where = f"; first at {figures['first_difference']}" if figures["first_difference"] else ""
    return CheckResult("batch_invariance", FAIL,
                       f"{figures['differing_samples']} of {n} differ, max abs dlogp "
                       f"{figures['max_abs_logprob_diff']:.2e}", detail + where, figures)


def check_train_step(info, cfg, hf_config, *, sequences: int, seq_len: int) -> tuple[CheckResult, CheckResult]:
    """One optimizer step of a random-weight model on random tokens: tokens/s, MFU, peak memory vs the plan."""
    import torch

    from mcpo_megatron.trainer.components import build_policy

    policy = build_policy(cfg, None, info, hf_config, load_weights=False)
    prompt = seq_len // 4
    mine = max(1, sequences // info.dp)
    batch, loss_fn = _random_batch(policy, info, hf_config.vocab_size, sequences=mine, seq_len=seq_len,
                                   prompt=prompt)
    policy.train_step(batch, loss_fn)  # warm-up (allocations, kernels)
    if info.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    _sync(info)
    t0 = time.perf_counter()
    out = policy.train_step(batch, loss_fn)
    _sync(info)
    seconds = time.perf_counter() - t0
    step_row = _step_row(info, cfg, out, seconds, sequences=mine, seq_len=seq_len, prompt=prompt)
    return step_row, _memory_row(info, cfg, prompt=prompt, response=seq_len - prompt)


def _random_batch(policy, info, vocab_size: int, *, sequences: int, seq_len: int, prompt: int):
    """This DP rank's ``sequences`` random sequences with their old log-probs, advantages of +-1 and global
    token weights, and the policy loss over them."""
    import torch

    from mcpo_megatron.algorithms import losses
    from mcpo_megatron.models.batch import SequenceBatch

    mine = sequences
    gen = torch.Generator().manual_seed(info.dp_rank)
    ids = [torch.randint(0, vocab_size, (seq_len,), generator=gen) for _ in range(mine)]
    batch = SequenceBatch(input_ids=ids, prompt_lens=torch.full((mine,), prompt),
                          response_lens=torch.full((mine,), seq_len - prompt))
    old, _ = policy.compute_logprobs(batch, compute_entropy=False)
    total_tokens = mine * info.dp * (seq_len - prompt)
    batch.token_fields.update(
        old_logp=old, advantages=[torch.full((seq_len - prompt,), 1.0 if i % 2 else -1.0) for i in range(mine)],
        pg_weight=[torch.full((seq_len - prompt,), 1.0 / total_tokens) for _ in range(mine)])

    def loss_fn(logp, entropy, mb):
        f = mb.token_fields
        return losses.policy_loss(losses.LossInputs(logp, f["old_logp"], f["advantages"], f["pg_weight"], mb.mask))

    return batch, loss_fn


def _step_row(info, cfg, out: dict, seconds: float, *, sequences: int, seq_len: int, prompt: int) -> CheckResult:
    """The train_step row: tokens/s and, on a GPU of known peak, MFU; fails when the gradient was not finite."""
    from mcpo_megatron import accounting
    from mcpo_megatron.config import model_shape as config_shape
    from mcpo_megatron.planner import param_counts

    mine = sequences
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
    return CheckResult("train_step", PASS if finite else FAIL, figure,
                       f"{data['params'] / 1e6:,.1f}M params, {mine * info.dp} x {seq_len} tokens, TP={info.tp} "
                       f"DP={info.dp}" + ("" if peak is not None else "; MFU needs a GPU of known peak")
                       + ("" if finite else "; the gradient was NOT finite"), data)


def _memory_row(info, cfg, *, prompt: int, response: int) -> CheckResult:
    """Peak memory of the step (collective: the largest over the ranks) against mcpo plan's training phase."""
    from mcpo_megatron import accounting
    from mcpo_megatron.config import model_shape as config_shape
    from mcpo_megatron.planner import estimate_training_memory

    peak_bytes = accounting.peak_memory_bytes(all_ranks=True)
    planned = step_plan_config(cfg, prompt, response)
    estimate = sum(t.bytes for t in estimate_training_memory(config_shape(planned), planned, info.world_size).values())
    mem = {"peak_bytes": peak_bytes, "plan_bytes": estimate}
    if info.device.type != "cuda":
        return CheckResult("memory", SKIP, f"{peak_bytes / 2**30:.2f} GiB RSS",
                           f"the plan models GPU memory ({estimate / 2**30:.3f} GiB here); on CPU the process RSS "
                           "includes the interpreter and libraries", mem)
    ok = peak_bytes <= MEMORY_SLACK * estimate
    return CheckResult("memory", PASS if ok else FAIL,
                       f"{peak_bytes / 2**30:.2f} of {estimate / 2**30:.2f} GiB planned",
                       f"peak allocated in the step vs mcpo plan's training phase (fails above "
                       f"{MEMORY_SLACK:g}x: the plan would under-provision)", mem)


def _peak_flops(info) -> float | None:
    import torch

    if info.device.type != "cuda":
        return None
    return peak_flops_of(torch.cuda.get_device_name(info.device))


def peak_flops_of(gpu_name: str) -> float | None:
    """Dense bf16 peak FLOP/s of the GPU named ``gpu_name`` (None when GPU_PEAK_FLOPS does not know it)."""
    return next((peak for key, peak in GPU_PEAK_FLOPS.items() if key in gpu_name), None)


def step_plan_config(cfg, prompt_len: int, response_len: int):
    """``cfg`` as ``mcpo plan`` must see the train-step check: its sequence lengths (not the engine check's short
    ones) and the layer implementation the step really ran (``auto`` is planned as Transformer Engine, whose fused
    attention keeps no score matrix; without it megatron's local attention does)."""
    from omegaconf import OmegaConf

    from mcpo_megatron.models.megatron_config import resolve_impl

    planned = OmegaConf.merge(cfg, {"data": {"max_prompt_length": prompt_len, "max_response_length": response_len},
                                    "model": {"transformer_impl": resolve_impl(cfg.model.transformer_impl)}})
    return planned
