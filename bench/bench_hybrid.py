"""A hybrid decoder's training step against the same-size Qwen3, side by side in one run.

Two ``MegatronPolicy`` models of the same hidden size, MLP width, layers, attention heads and vocabulary, random
weights: a Qwen3 (every layer full attention) and a Qwen3.5 (``Qwen3_5ForCausalLM``: a full-attention layer with
an output gate every ``--full-attention-interval`` layers, the others Gated DeltaNet layers of
``--linear-key-heads`` key heads and ``--linear-value-heads`` value heads). Their ``train_step`` on the same token
batch is timed in alternation (Qwen3, Qwen3.5, Qwen3, ...), so both see the same machine state. The table gives,
per model, its parameters, the median step, tokens/s, model TFLOP/s (``mcpo_megatron.accounting``: the Gated
DeltaNet's projections and delta rule, no sequence-length term) and the ratio of its tokens/s to Qwen3's.

On a CPU the Gated DeltaNet runs the plain-torch chunked recurrence (``parallel/cpu_linear_attention.py``) that
the CPU support code installs in place of flash-linear-attention's Triton kernels, so the ratio measures that
reference, not the GPU kernels; on GPUs megatron-core runs flash-linear-attention (the ``gpu`` extra).

    python bench/bench_hybrid.py                                  # CPU defaults, one process
    torchrun --nproc_per_node 2 bench/bench_hybrid.py --tp 2       # the GDN heads and attention split over TP
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

FAMILIES = ("qwen3", "qwen3_5")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4, help="decoder layers")
    ap.add_argument("--hidden", type=int, default=256, help="hidden size")
    ap.add_argument("--heads", type=int, default=4, help="attention heads")
    ap.add_argument("--kv-heads", type=int, default=2, help="key/value heads of the attention layers")
    ap.add_argument("--head-dim", type=int, default=64, help="attention head size")
    ap.add_argument("--ffn", type=int, default=768, help="MLP width")
    ap.add_argument("--vocab", type=int, default=4096, help="vocabulary size")
    ap.add_argument("--full-attention-interval", type=int, default=4,
                    help="Qwen3.5: a full-attention layer every N layers (the last of each N)")
    ap.add_argument("--linear-key-heads", type=int, default=4, help="Qwen3.5: Gated DeltaNet key heads")
    ap.add_argument("--linear-value-heads", type=int, default=8, help="Qwen3.5: Gated DeltaNet value heads")
    ap.add_argument("--linear-head-dim", type=int, default=64, help="Qwen3.5: Gated DeltaNet key and value head size")
    ap.add_argument("--conv", type=int, default=4, help="Qwen3.5: the causal convolution's width")
    ap.add_argument("--seqs", type=int, default=4, help="sequences per DP rank")
    ap.add_argument("--prompt-len", type=int, default=32, help="prompt tokens")
    ap.add_argument("--response-len", type=int, default=224, help="response tokens")
    ap.add_argument("--max-tokens-per-microbatch", type=int, default=1024, help="token budget of a micro-batch")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    ap.add_argument("--dtype", choices=("bf16", "fp32", "auto"), default="auto", help="bf16 on GPU by default")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps of each model")
    ap.add_argument("--steps", type=int, default=3, help="timed steps of each model")
    ap.add_argument("--json", default=None, help="also write the figures to this JSON file (rank 0)")
    return ap.parse_args(argv)


def hf_config(a, family: str):
    """The transformers config of one of the two models: the shared sizes, and Qwen3.5's layer pattern and GDN."""
    from transformers import Qwen3_5TextConfig, Qwen3Config

    common = dict(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.ffn, num_hidden_layers=a.layers,
                  num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, head_dim=a.head_dim,
                  max_position_embeddings=max(4096, a.prompt_len + a.response_len), rms_norm_eps=1e-6,
                  tie_word_embeddings=False)
    if family == "qwen3":
        cfg = Qwen3Config(**common)
        cfg.architectures = ["Qwen3ForCausalLM"]
        return cfg
    every = a.full_attention_interval
    cfg = Qwen3_5TextConfig(**common, linear_num_key_heads=a.linear_key_heads,
                            linear_num_value_heads=a.linear_value_heads, linear_key_head_dim=a.linear_head_dim,
                            linear_value_head_dim=a.linear_head_dim, linear_conv_kernel_dim=a.conv,
                            layer_types=["full_attention" if (i + 1) % every == 0 else "linear_attention"
                                         for i in range(a.layers)])
    cfg.architectures = ["Qwen3_5ForCausalLM"]
    return cfg


def config_shape(cfg):
    """The model's shape as the planner and the FLOP accounting read a config.json."""
    from mcpo_megatron.config.shapes import _shape_from_hf

    return _shape_from_hf(cfg.to_dict(), "bench")


def build_policy(a, family: str, info, dtype):
    from mcpo_megatron.models.optim import OptimSettings
    from mcpo_megatron.models.policy import MegatronPolicy
    from mcpo_megatron.models.policy_settings import PolicySettings

    settings = PolicySettings(dtype=dtype, optim=OptimSettings(lr=1e-6, use_distributed_optimizer=True),
                              max_tokens_per_microbatch=a.max_tokens_per_microbatch, transformer_impl="local")
    return MegatronPolicy(None, settings, hf_config=hf_config(a, family), parallel_info=info, load_weights=False)


def time_alternately(policies: dict, batch, a, on_gpu: bool) -> dict[str, list[float]]:
    """Seconds of each timed ``train_step`` per model, the models taking turns step by step."""
    from bench_train_step import loss_fn
    from tqdm import tqdm

    times: dict[str, list[float]] = {name: [] for name in policies}
    rank0 = next(iter(policies.values())).info.rank == 0
    for i in tqdm(range(a.warmup + a.steps), desc="train_step x 2 models", disable=not rank0):
        for name, policy in policies.items():
            if on_gpu:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            policy.train_step(batch, loss_fn)
            if on_gpu:
                torch.cuda.synchronize()
            if i >= a.warmup:
                times[name].append(time.perf_counter() - t0)
    return times


def figures(a, info, times: dict[str, list[float]], dtype_name: str) -> dict:
    from mcpo_megatron.accounting import model_flops
    from mcpo_megatron.planner import param_counts

    n_all = a.seqs * info.dp
    tokens = n_all * (a.prompt_len + a.response_len)
    rows = {}
    for family, ts in times.items():
        shape = config_shape(hf_config(a, family))
        t = statistics.median(ts)
        flops = model_flops(shape, kind="train", prompt_lens=[a.prompt_len] * n_all,
                            response_lens=[a.response_len] * n_all)
        rows[family] = dict(params=param_counts(shape, 1, 1)["total"], step_seconds=t, step_seconds_all=ts,
                            tokens_per_s=tokens / t, tflops_per_s=flops / t / 1e12, flops_per_step=flops,
                            linear_attention_layers=shape.num_linear_attention_layers)
    base = rows["qwen3"]["tokens_per_s"]
    for row in rows.values():
        row["vs_qwen3"] = row["tokens_per_s"] / base
    return dict(machine=describe(), device="cuda" if torch.cuda.is_available() else "cpu", tp=info.tp, dp=info.dp,
                world_size=info.world_size, dtype=dtype_name, tokens_per_step=tokens, models=rows)


def print_table(a, out: dict) -> None:
    print(out["machine"])
    print(f"layout TP={out['tp']} DP={out['dp']}, {out['dtype']}, {out['tokens_per_step']} tokens a step "
          f"({a.seqs} x {a.prompt_len}+{a.response_len} per DP rank), L={a.layers} h={a.hidden} "
          f"heads={a.heads}/{a.kv_heads}x{a.head_dim} ffn={a.ffn} V={a.vocab}; Qwen3.5: full attention every "
          f"{a.full_attention_interval}, GDN {a.linear_key_heads}/{a.linear_value_heads} heads x "
          f"{a.linear_head_dim}, conv {a.conv}")
    print("| model | GDN layers | params | step s (median) | tokens/s | model TFLOP/s | tokens/s vs Qwen3 |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for family, r in out["models"].items():
        print(f"| {family} | {r['linear_attention_layers']} | {r['params'] / 1e6:.2f} M | {r['step_seconds']:.3f} | "
              f"{r['tokens_per_s']:,.0f} | {r['tflops_per_s']:.4f} | {r['vs_qwen3']:.2f} |")


def main(argv=None) -> int:
    a = parse_args(argv)
    from bench_train_step import make_batch

    from mcpo_megatron.parallel.distributed import destroy_distributed, init_distributed

    on_gpu = torch.cuda.is_available()
    info = init_distributed(a.tp, 1, seed=0)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "auto": None}[a.dtype]
    policies = {family: build_policy(a, family, info, dtype) for family in FAMILIES}
    batch = make_batch(a, a.vocab, seed=info.dp_rank)
    times = time_alternately(policies, batch, a, on_gpu)
    if info.rank == 0:
        dtype_name = "bf16" if policies["qwen3"].dtype == torch.bfloat16 else "fp32"
        out = figures(a, info, times, dtype_name)
        print_table(a, out)
        if a.json:
            Path(a.json).write_text(json.dumps(out, indent=2))
    destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
