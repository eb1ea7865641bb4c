"""Benchmark: sequence packing (THD bins) against padded micro-batches, side by side in one run.

Two length distributions:

* ``demo``: the CPU demo's (``configs/cpu_smollm2_arith.yaml``): prompts of 20-96 tokens, replies of 1-16;
* ``long-tail``: a reasoning run's (the recipes' 2,048-token prompts and 20,480-token replies): prompts of 64-512
  tokens, replies log-normal around 2,000 tokens with a long tail cut at 20,480 (the replies that hit the limit).

For each, at full size and with the recipes' token budget (``--budget``, 24,576: one 2,048 + 20,480-token
sequence fits), the padding waste: the tokens the padded micro-batches compute that are not real tokens
(``models.batch.make_microbatches``, every row padded to its micro-batch's longest), against the packed bins
(``models.packing.packed_microbatches``), and the attention work (sum of b x S^2 against sum of L^2).

Then the tokens/s of ``MegatronPolicy.forward_backward`` on this machine, packed and padded, with a tiny
random Qwen3 (the CPU's local layer spec; packed bins use the reference core attention of
``parallel/cpu_attention.py``): the long-tailed lengths and the budget are divided by ``--scale`` so that a
CPU step takes seconds.  On GPUs Transformer Engine's THD kernels replace the reference attention; their speed
is not measured here.

    python bench/bench_packing.py                   # 64 sequences per distribution, scale 64
    python bench/bench_packing.py --seqs 8 --scale 512 --repeats 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from machine import describe

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from mcpo_megatron.models.batch import SequenceBatch, make_microbatches  # noqa: E402
from mcpo_megatron.models.packing import packed_microbatches  # noqa: E402

MAX_RESPONSE = 20_480
DEMO_BUDGET = 4096  # configs/cpu_smollm2_arith.yaml's trainer.max_tokens_per_microbatch


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Padding waste and tokens/s: packed (THD) vs padded micro-batches")
    p.add_argument("--seqs", type=int, default=64, help="sequences per distribution (one DP rank's share)")
    p.add_argument("--budget", type=int, default=24_576, help="tokens per micro-batch at full size")
    p.add_argument("--scale", type=int, default=64, help="the long-tailed lengths and budget are divided by it "
                                                          "for the timed CPU steps")
    p.add_argument("--repeats", type=int, default=3, help="timed forward-backward passes (median)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def lengths(kind: str, n: int, seed: int) -> tuple[list[int], list[int]]:
    """(prompt lengths, response lengths) of ``n`` sequences of distribution ``kind``."""
    g = torch.Generator().manual_seed(seed)
    if kind == "demo":
        return (torch.randint(20, 97, (n,), generator=g).tolist(), torch.randint(1, 17, (n,), generator=g).tolist())
    prompts = torch.randint(64, 513, (n,), generator=g).tolist()
    replies = torch.exp(7.6 + 1.0 * torch.randn(n, generator=g)).clamp(1, MAX_RESPONSE).long().tolist()
    return prompts, replies


def make_batch(prompt_lens: list[int], response_lens: list[int], vocab: int, seed: int) -> SequenceBatch:
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(3, vocab, (p + r,), generator=g) for p, r in zip(prompt_lens, response_lens)]
    total = max(1, sum(response_lens))
    return SequenceBatch(input_ids=ids, prompt_lens=torch.tensor(prompt_lens),
                         response_lens=torch.tensor(response_lens),
                         token_fields={"w": [torch.full((r,), 1.0 / total) for r in response_lens]})


def work(batch: SequenceBatch, budget: int, packed: bool) -> dict:
    """Computed tokens, attention work and micro-batch count of one way of cutting ``batch``."""
    mbs = packed_microbatches(batch, budget) if packed else make_microbatches(batch, budget)
    computed = sum(mb.input_ids.numel() for mb in mbs)
    if packed:
        attention = sum(int(n) ** 2 for mb in mbs for n in mb.packing.cu_seqlens.diff().tolist())
    else:
        attention = sum(mb.input_ids.shape[0] * mb.seq_length ** 2 for mb in mbs)
    return {"computed": computed, "attention": attention, "microbatches": len(mbs)}


def loss_fn(logp, entropy, mb):
    return -(logp * mb.token_fields["w"]).sum(), {}


def timed_steps(policy, batch: SequenceBatch, packed: bool, repeats: int) -> float:
    policy.sequence_packing = packed
    policy.forward_backward(batch, loss_fn)  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        policy.forward_backward(batch, loss_fn)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> int:
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    from mcpo_megatron.models.optim import OptimSettings
    from mcpo_megatron.models.policy import MegatronPolicy
    from mcpo_megatron.models.policy_settings import PolicySettings
    from mcpo_megatron.models.tiny import tiny_hf_config
    from mcpo_megatron.parallel.distributed import destroy_distributed, init_distributed

    info = init_distributed(1, 1, seed=0)
    hf = tiny_hf_config("qwen3", max_position_embeddings=2 * (MAX_RESPONSE + 512))
    settings = PolicySettings(dtype=torch.float32, optim=OptimSettings(lr=1e-6, use_distributed_optimizer=False),
                              transformer_impl="local")
    policy = MegatronPolicy(None, settings, hf_config=hf, parallel_info=info, load_weights=False)
    rows = []
    for kind, budget, scale in (("demo", DEMO_BUDGET, 1), ("long-tail", a.budget, a.scale)):
        prompts, replies = lengths(kind, a.seqs, a.seed)
        full = make_batch(prompts, replies, hf.vocab_size, a.seed)
        small = make_batch([max(1, p // scale) for p in prompts], [max(1, r // scale) for r in replies],
                           hf.vocab_size, a.seed)
        policy.max_tokens_per_microbatch = max(1, budget // scale)
        real = int(full.seq_lens().sum())
        for packed in (False, True):
            w = work(full, budget, packed)
            seconds = timed_steps(policy, small, packed, a.repeats)
            rows.append(dict(kind=kind, mode="packed" if packed else "padded", seqs=a.seqs, real=real, **w,
                             waste=1 - real / w["computed"], seconds=seconds,
                             tokens_per_s=int(small.seq_lens().sum()) / seconds, scale=scale))
    print(describe())
    print(f"{'case':<19}  {'seqs':>5}  {'real tok':>9}  {'computed tok':>12}  {'padding %':>9}  "
          f"{'attn work':>10}  {'micro-b':>7}  {'scale':>5}  {'step s':>8}  {'tokens/s':>9}  {'speedup':>7}")
    print("-" * 124)
    for r in rows:
        base = next(x for x in rows if x["kind"] == r["kind"] and x["mode"] == "padded")
        print(f"{r['kind'] + ' ' + r['mode']:<19}  {r['seqs']:>5}  {r['real']:>9}  {r['computed']:>12}  "
              f"{100 * r['waste']:>9.1f}  {r['attention'] / base['attention']:>10.3f}  {r['microbatches']:>7}  "
              f"{r['scale']:>5}  {r['seconds']:>8.3f}  {r['tokens_per_s']:>9.0f}  "
              f"{r['tokens_per_s'] / base['tokens_per_s']:>7.2f}")
    print("\npadding %, attention work (relative to padded) and micro-batches: full-size lengths and budget; step s "
          "and tokens/s: forward-backward of the tiny model on lengths and budget divided by scale (CPU, reference "
          "attention for the packed bins)")
    destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
