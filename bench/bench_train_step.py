"""Throughput of ``MegatronPolicy.train_step``: tokens/s, achieved FLOP/s and MFU.

The model is Qwen3-8B-shaped (hidden 4096, 32 heads / 8 KV heads of 128, FFN 12288,
vocab 151936, q/k norms) with ``--layers`` decoder layers (as many as fit), random
weights, bf16 on GPUs.  ``--moe`` makes it Qwen3-30B-A3B-shaped instead (hidden 2048,
32 heads / 4 KV heads of 128, 128 experts of width 768, 8 per token; ``--ep`` experts
ranks).  On a CPU the default shape is scaled down (``--hidden`` etc.) and fp32; MFU
needs a GPU's peak, so on CPU only achieved FLOP/s is reported.  With experts the
FLOPs (and MFU) count the k experts a token visits and the router (active parameters).

Run under torchrun for TP/PP (``torchrun --nproc_per_node 2 bench/bench_train_step.py --tp 2``)
or as a plain single process.

FLOPs of one step come from the shared accounting module
(``mcpo_megatron.accounting.model_flops(kind="train")``): model FLOPs in the PaLM /
Megatron-LM convention, forward + backward = 3 x forward, where one forward over a
sequence of S tokens is

    S * 2 * (h*a*d + 2*h*k*d + a*d*h + 3*h*f) * L      (linear layers)
  + 2 * 2 * a*d * S(S+1)/2 * L                         (causal scores + context)
  + 2 * h * V * S                                      (LM head at every position)

(h hidden, a/k query/KV heads of size d, f FFN width, L layers, V vocabulary); i.e.
about 6 * params * tokens plus the attention term.  No recomputation, optimizer or
element-wise work is counted.  T counts real (unpadded) tokens of the step over all
DP ranks.

MFU = FLOPs / (step time * number of GPUs * peak FLOP/s per GPU) with ``--peak-tflops``
(default 989, H100 SXM dense bf16).

Peak memory: the CUDA allocator's peak of allocated bytes over all steps (the busiest
rank), against ``mcpo plan``'s training-phase estimate for the same shape, layout, token
budget and layer spec (``mcpo_megatron.planner.estimate_training_memory``: its terms
without the fixed reserve, which covers what the allocator does not count); the
``mcpo plan`` overrides that give the same estimate are printed.  On CPU the process's
peak RSS is reported (it includes the interpreter and libraries; not compared).
``--json PATH`` also writes the figures (rank 0).

About 1B parameters at 4,096-token sequences on one GPU (the GPU kit's shape):

    python bench/bench_train_step.py --layers 16 --hidden 2048 --heads 16 --kv-heads 8 --ffn 6144 \
        --tie-embeddings --seqs 4 --prompt-len 1024 --response-len 3072 --max-tokens-per-microbatch 4096
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from machine import describe  # noqa: E402

QWEN3_8B = dict(hidden=4096, heads=32, kv_heads=8, head_dim=128, ffn=12288, vocab=151936)
CPU_SMALL = dict(hidden=256, heads=4, kv_heads=2, head_dim=64, ffn=768, vocab=4096)
QWEN3_30B_A3B = dict(hidden=2048, heads=32, kv_heads=4, head_dim=128, ffn=6144, vocab=151936, experts=128, topk=8,
                     moe_ffn=768)
CPU_SMALL_MOE = dict(CPU_SMALL, experts=8, topk=2, moe_ffn=128)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: 4 on GPU, 2 on CPU)")
    ap.add_argument("--hidden", type=int, default=None, help="hidden size (default: Qwen3-8B on GPU, 256 on CPU)")
    ap.add_argument("--heads", type=int, default=None, help="attention heads")
    ap.add_argument("--kv-heads", type=int, default=None, help="key/value heads")
    ap.add_argument("--head-dim", type=int, default=None, help="head dimension")
    ap.add_argument("--ffn", type=int, default=None, help="MLP intermediate size")
    ap.add_argument("--vocab", type=int, default=None, help="vocabulary size")
    ap.add_argument("--tie-embeddings", action="store_true", help="share the input embedding and the LM head")
    ap.add_argument("--seqs", type=int, default=None, help="sequences per DP rank (default 16 GPU, 4 CPU)")
    ap.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 512 GPU, 32 CPU)")
    ap.add_argument("--response-len", type=int, default=None, help="response tokens (default 1536 GPU, 96 CPU)")
    ap.add_argument("--max-tokens-per-microbatch", type=int, default=None,
                    help="padded-token budget per micro-batch (default 8192 GPU, 512 CPU)")
    ap.add_argument("--logprob-chunk-size", type=int, default=4096,
                    help="tokens per chunk of the log-prob kernel (trainer.logprob_chunk_size; default 4096)")
    ap.add_argument("--transformer-impl", choices=("auto", "local", "transformer_engine"), default="auto",
                    help="layer spec (auto: Transformer Engine when installed on a GPU, else local)")
    ap.add_argument("--moe", action="store_true", help="Qwen3-30B-A3B-shaped mixture of experts")
    ap.add_argument("--experts", type=int, default=None, help="experts (with --moe)")
    ap.add_argument("--topk", type=int, default=None, help="experts per token (with --moe)")
    ap.add_argument("--moe-ffn", type=int, default=None, help="expert width (with --moe)")
    ap.add_argument("--ep", type=int, default=1, help="expert-parallel size (with --moe)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size (MoE at TP > 1 runs sequence parallel)")
    ap.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    ap.add_argument("--dtype", choices=("bf16", "fp32", "auto"), default="auto", help="bf16 on GPU by default")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps")
    ap.add_argument("--steps", type=int, default=3, help="timed steps")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="peak dense TFLOP/s of one GPU (MFU)")
    ap.add_argument("--json", default=None, help="also write the figures to this JSON file (rank 0)")
    return ap.parse_args(argv)


def hf_config(a):
    from transformers import Qwen3Config, Qwen3MoeConfig

    common = dict(
        vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.ffn, num_hidden_layers=a.layers,
        num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, head_dim=a.head_dim,
        max_position_embeddings=max(4096, a.prompt_len + a.response_len), rms_norm_eps=1e-6,
        tie_word_embeddings=a.tie_embeddings,
    )
    if a.moe:
        cfg = Qwen3MoeConfig(**common, num_experts=a.experts, num_experts_per_tok=a.topk,
                             moe_intermediate_size=a.moe_ffn, norm_topk_prob=True)
        cfg.architectures = ["Qwen3MoeForCausalLM"]
        return cfg
    cfg = Qwen3Config(**common)
    cfg.architectures = ["Qwen3ForCausalLM"]
    return cfg


def accounting_shape(a) -> dict:
    """The model shape in ``mcpo_megatron.accounting``'s field names."""
    shape = dict(hidden_size=a.hidden, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                 head_dim=a.head_dim, ffn_hidden_size=a.ffn, num_layers=a.layers, vocab_size=a.vocab)
    if a.moe:
        shape.update(num_experts=a.experts, num_experts_per_tok=a.topk, moe_ffn_hidden_size=a.moe_ffn)
    return shape


def plan_overrides(a, tp: int, pp: int, dtype: str, impl: str) -> list[str]:
    """The config overrides under which ``mcpo plan`` estimates this benchmark's step: its shape as model.arch,
    layout, dtype, layer spec, token budget and sequence lengths."""
    arch = dict(num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.heads,
                num_key_value_heads=a.kv_heads, ffn_hidden_size=a.ffn, vocab_size=a.vocab, head_dim=a.head_dim,
                max_position_embeddings=max(4096, a.prompt_len + a.response_len),
                tie_word_embeddings=a.tie_embeddings, family="qwen3_moe" if a.moe else "qwen3")
    if a.moe:
        arch.update(num_experts=a.experts, num_experts_per_tok=a.topk, moe_ffn_hidden_size=a.moe_ffn)
    def text(v):  # YAML's spelling of booleans
        return str(v).lower() if isinstance(v, bool) else v

    return [f"model.arch.{k}={text(v)}" for k, v in arch.items()] + [
        f"model.dtype={dtype}", f"model.transformer_impl={impl}",
        f"parallelism.tensor_model_parallel_size={tp}", f"parallelism.pipeline_model_parallel_size={pp}",
        f"parallelism.expert_model_parallel_size={a.ep}",
        f"parallelism.sequence_parallel={text(a.moe and tp > 1)}",
        "parallelism.use_distributed_optimizer=true",
        f"trainer.max_tokens_per_microbatch={a.max_tokens_per_microbatch}",
        f"trainer.logprob_chunk_size={a.logprob_chunk_size}",
        f"data.max_prompt_length={a.prompt_len}", f"data.max_response_length={a.response_len}"]


def planned_bytes(overrides: list[str], world: int) -> dict[str, float]:
    """``mcpo plan``'s training-phase terms (bytes per GPU, the fixed reserve left out) under ``overrides``."""
    from mcpo_megatron.config import load_config, model_shape
    from mcpo_megatron.planner import estimate_training_memory

    cfg = load_config(None, overrides)
    return {name: term.bytes for name, term in estimate_training_memory(model_shape(cfg), cfg, world).items()}


def matmul_params(a) -> int:
    """Parameters used in matrix multiplies per token (decoder + output layer; not the embedding lookup; with
    experts, the k experts a token visits and the router)."""
    q, kv = a.heads * a.head_dim, a.kv_heads * a.head_dim
    mlp = (a.topk * 3 * a.hidden * a.moe_ffn + a.hidden * a.experts) if a.moe else 3 * a.hidden * a.ffn
    return a.layers * (a.hidden * (q + 2 * kv) + q * a.hidden + mlp) + a.vocab * a.hidden


def step_flops(a, prompt_lens: list[int], response_lens: list[int]) -> float:
    """Model FLOPs of one train_step (see the module docstring)."""
    from mcpo_megatron.accounting import model_flops

    return model_flops(accounting_shape(a), kind="train", prompt_lens=prompt_lens, response_lens=response_lens)


def make_batch(a, vocab: int, seed: int):
    from mcpo_megatron.algorithms.losses import local_counts, token_weights
    from mcpo_megatron.models.batch import SequenceBatch

    g = torch.Generator().manual_seed(seed)
    n, p, r = a.seqs, a.prompt_len, a.response_len
    ids = [torch.randint(0, vocab, (p + r,), generator=g) for _ in range(n)]
    mask = torch.ones(n, r, dtype=torch.bool)
    mastered = torch.zeros(n, dtype=torch.bool)
    pg, _ = token_weights(mask, mastered, loss_agg_mode="seq-mean-token-mean",
                          global_counts=local_counts(mask, mastered))
    return SequenceBatch(
        input_ids=ids,
        prompt_lens=torch.full((n,), p),
        response_lens=torch.full((n,), r),
        token_fields={"old_logp": [torch.full((r,), -2.0) for _ in range(n)], "pg_weight": list(pg)},
        seq_fields={"advantage": torch.randn(n, generator=g)},
    )


def loss_fn(logp, entropy, mb):
    from mcpo_megatron.algorithms.losses import LossInputs, policy_loss

    f = mb.token_fields
    return policy_loss(LossInputs(logp, f["old_logp"], mb.seq_fields["advantage"], f["pg_weight"], mb.mask))


def fill_defaults(a: argparse.Namespace, on_gpu: bool) -> None:
    """The model shape and step size left unset: Qwen3-8B (or -30B-A3B with --moe) at 4 layers on a GPU, a small
    model on CPU."""
    if a.moe:
        base = QWEN3_30B_A3B if on_gpu else CPU_SMALL_MOE
    else:
        base = QWEN3_8B if on_gpu else CPU_SMALL
    for key in ("hidden", "heads", "head_dim", "ffn", "vocab") + (("experts", "topk", "moe_ffn") if a.moe else ()):
        if getattr(a, key) is None:
            setattr(a, key, base[key])
    if a.kv_heads is None:
        a.kv_heads = base["kv_heads"]
    defaults = dict(layers=4, seqs=16, prompt_len=512, response_len=1536, max_tokens_per_microbatch=8192) \
        if on_gpu else dict(layers=2, seqs=4, prompt_len=32, response_len=96, max_tokens_per_microbatch=512)
    for key, value in defaults.items():
        if getattr(a, key) is None:
            setattr(a, key, value)


def time_steps(policy, batch, a: argparse.Namespace, on_gpu: bool) -> tuple[list[float], dict]:
    """(seconds of each counted step, the last step's metrics): ``a.warmup`` steps, then ``a.steps`` timed."""
    from tqdm import tqdm

    times, metrics = [], {}
    for i in tqdm(range(a.warmup + a.steps), desc="train_step", disable=policy.info.rank != 0):
        if on_gpu:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        metrics = policy.train_step(batch, loss_fn)
        if on_gpu:
            torch.cuda.synchronize()
        if i >= a.warmup:
            times.append(time.perf_counter() - t0)
    return times, metrics


def report(a: argparse.Namespace, info, policy, impl: str, measured: tuple[list[float], dict, int]) -> None:
    """The table (and --json) of the ``measured`` (step seconds, last metrics, peak bytes) on rank 0."""
    from mcpo_megatron.accounting import mfu

    times, metrics, peak_bytes = measured
    on_gpu = torch.cuda.is_available()
    n_all = a.seqs * info.dp
    prompt_lens, response_lens = [a.prompt_len] * n_all, [a.response_len] * n_all
    t = statistics.median(times)
    flops = step_flops(a, prompt_lens, response_lens)
    tokens = sum(prompt_lens) + sum(response_lens)
    dtype_name = "bf16" if policy.dtype == torch.bfloat16 else "fp32"
    overrides = plan_overrides(a, info.tp, info.pp, dtype_name, impl)
    plan = planned_bytes(overrides, info.world_size)
    plan_total = sum(plan.values())
    figures = dict(
        machine=describe(), device="cuda" if on_gpu else "cpu", world_size=info.world_size, tp=info.tp,
        pp=info.pp, dp=info.dp, ep=info.ep, dtype=dtype_name, transformer_impl=impl,
        matmul_params=matmul_params(a), tokens_per_step=tokens, seqs_per_rank=a.seqs,
        prompt_len=a.prompt_len, response_len=a.response_len,
        max_tokens_per_microbatch=a.max_tokens_per_microbatch, microbatches=metrics.get("num_microbatches"),
        step_seconds=t, step_seconds_all=times, tokens_per_s=tokens / t, tflops_per_s=flops / t / 1e12,
        flops_per_step=flops, peak_tflops=a.peak_tflops,
        mfu=mfu(flops / t / info.world_size, a.peak_tflops * 1e12) if on_gpu else None,
        peak_memory_bytes=peak_bytes, peak_memory_kind="cuda max allocated" if on_gpu else "process max RSS",
        plan_bytes=plan_total, plan_terms=plan, plan_overrides=overrides, grad_norm=metrics.get("grad_norm"),
        skipped=metrics.get("skipped"))
    rows = [
        ("machine", describe().removeprefix("machine: ")),
        ("layout", f"TP={info.tp} PP={info.pp} DP={info.dp} EP={info.ep} ({info.world_size} ranks)"),
        ("shape", f"L={a.layers} h={a.hidden} heads={a.heads}/{a.kv_heads}x{a.head_dim} "
                  + (f"experts={a.experts} top-{a.topk} x {a.moe_ffn}" if a.moe else f"ffn={a.ffn}")
                  + f" V={a.vocab}"),
        ("dtype", str(policy.dtype).replace("torch.", "")),
        ("matmul params" + (" (active)" if a.moe else ""), f"{matmul_params(a) / 1e6:.1f} M"),
        ("tokens / step", f"{tokens} ({a.seqs} x {a.prompt_len}+{a.response_len} per DP rank)"),
        ("micro-batches / step", str(metrics.get("num_microbatches"))),
        ("step time (median)", f"{t:.3f} s over {len(times)} steps"),
        ("tokens/s", f"{tokens / t:,.0f}"),
        ("achieved TFLOP/s (total)", f"{flops / t / 1e12:.4f}"),
        ("MFU", f"{figures['mfu']:.1%} of {a.peak_tflops:g} TFLOP/s per GPU" if on_gpu
                else "n/a (needs a GPU peak)"),
        ("layer spec", impl),
        ("peak memory (busiest rank)", f"{peak_bytes / 2**30:.2f} GiB ({figures['peak_memory_kind']})"),
        ("mcpo plan, training phase", f"{plan_total / 2**30:.2f} GiB without the reserve ("
                                      + ", ".join(f"{k} {v / 2**30:.2f}" for k, v in plan.items()) + ")"),
    ]
    width = max(len(k) for k, _ in rows)
    print(f"{'metric'.ljust(width)} | value")
    print(f"{'-' * width}-|------")
    for k, v in rows:
        print(f"{k.ljust(width)} | {v}")
    print("plan overrides: " + " ".join(overrides))
    if a.json:
        Path(a.json).write_text(json.dumps(figures, indent=2))


def main(argv=None) -> int:
    a = parse_args(argv)
    on_gpu = torch.cuda.is_available()
    fill_defaults(a, on_gpu)
    from mcpo_megatron.accounting import peak_memory_bytes
    from mcpo_megatron.models.optim import OptimSettings
    from mcpo_megatron.models.policy import MegatronPolicy
    from mcpo_megatron.models.policy_settings import PolicySettings
    from mcpo_megatron.models.megatron_config import resolve_impl
    from mcpo_megatron.parallel.distributed import destroy_distributed, init_distributed

    info = init_distributed(a.tp, a.pp, seed=0, ep=a.ep)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "auto": None}[a.dtype]
    impl = resolve_impl(a.transformer_impl)
    settings = PolicySettings(dtype=dtype, optim=OptimSettings(lr=1e-6, use_distributed_optimizer=True),
                              max_tokens_per_microbatch=a.max_tokens_per_microbatch,
                              logprob_chunk_size=a.logprob_chunk_size, transformer_impl=impl,
                              sequence_parallel=a.moe and a.tp > 1)
    policy = MegatronPolicy(None, settings, hf_config=hf_config(a), parallel_info=info, load_weights=False)
    batch = make_batch(a, a.vocab, seed=info.dp_rank)
    times, metrics = time_steps(policy, batch, a, on_gpu)
    peak_bytes = peak_memory_bytes(all_ranks=True)  # a collective: every rank
    if info.rank == 0:
        report(a, info, policy, impl, (times, metrics, peak_bytes))
    destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
