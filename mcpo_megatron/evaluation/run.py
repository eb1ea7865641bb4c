"""Benchmark evaluation with a rollout engine and a scorer: used by periodic evaluation in training and by
``mcpo eval``.

Each benchmark is ``name`` (a prompt set of ``data.load_prompts``: aime_2024, aime_2025, amc_2023, champ,
arith, ...) or ``name@path`` (the same set from a local parquet/jsonl file in the hub schema). Every problem
gets ``k`` samples; the scores give pass@1, pass@k (unbiased and bootstrap) and the Table-1 layout.
"""

from __future__ import annotations

from typing import Sequence

from mcpo_megatron.rewards.distributed import DistributedScorer

EVAL_SEED = 20240607  # fixed, so two evaluations of the same weights sample the same responses


def parse_benchmark(entry: str) -> tuple[str, str | None]:
    name, _, path = entry.partition("@")  # not "=": set specs such as arith:ops=+ contain it
    return name.strip(), (path.strip() or None)


def evaluate_benchmarks(rollouts, tokenizer, cfg, info, scorer, stop_token_ids: Sequence[int], *,
                        progress: bool = False) -> dict:
    """{benchmark name: BenchmarkResult} for ``cfg.eval`` (benchmarks, num_problems, k, temperature, top_p,
    max_new_tokens).

    ``rollouts`` generates (``rollouts.generate(prompts, sampling, first_index=...)``: colocated engines,
    :class:`~mcpo_megatron.rollout.placement.LocalRollouts`, or engine ranks of their own).

    ``progress``: a bar per benchmark on rank 0 (``mcpo eval``); the prompts are then generated in pieces of
    ``rollout.generation_batch_size`` samples per replica, which gives the same samples (seeded by global
    prompt index)."""
    from mcpo_megatron.evaluation.metrics import score_samples
    from mcpo_megatron.rollout.engines.interface import SamplingParams

    e = cfg.eval
    sampling = SamplingParams(n=e.k, temperature=e.temperature, top_p=e.top_p, top_k=-1,
                              max_new_tokens=e.max_new_tokens or cfg.data.max_response_length,
                              stop_token_ids=tuple(stop_token_ids), seed=EVAL_SEED)
    dist_scorer = DistributedScorer(scorer, info.rank, info.world_size)
    results = {}
    for entry in e.benchmarks:
        name, records, prompts = benchmark_prompts(entry, tokenizer, cfg, num_samples=e.num_problems)
        out = _generate(rollouts, prompts, sampling, cfg, info, progress=progress, desc=f"eval {name}")
        texts = tokenizer.batch_decode(out.token_ids, skip_special_tokens=True)
        k = e.k
        rows = [texts[i * k:(i + 1) * k] for i in range(len(records))]
        lengths = [[len(t) for t in out.token_ids[i * k:(i + 1) * k]] for i in range(len(records))]
        truncated = [[f == "length" for f in out.finish_reasons[i * k:(i + 1) * k]] for i in range(len(records))]
        results[name] = score_samples(name, [r.ground_truth for r in records], rows, scorer=dist_scorer,
                                      response_lengths=lengths, truncated=truncated,
                                      uids=[r.uid for r in records], k=k)
    return results


def benchmark_prompts(entry: str, tokenizer, cfg, *, num_samples: int | None = None):
    """``(name, records, prompt token ids)`` of benchmark ``entry`` (``name`` or ``name@path``), untruncated."""
    from mcpo_megatron.data import build_prompt_token_ids, load_prompts
    from mcpo_megatron.tools.chat_calls import declared_tools

    name, path = parse_benchmark(entry)
    records, _ = load_prompts(name, path=path, split="test", num_samples=num_samples, seed=cfg.data.seed,
                              template=cfg.data.prompt_template)
    tools = declared_tools(cfg.tools)
    prompts = [build_prompt_token_ids(tokenizer, r, apply_chat_template=cfg.data.apply_chat_template,
                                      max_prompt_length=None, tools=tools) for r in records]
    return name, records, prompts


def check_eval_prompts(cfg, tokenizer, limit: int, limit_text: str, fix: str) -> None:
    """Raise ``ValueError`` unless every prompt of ``cfg.eval.benchmarks`` plus eval's response cap fits in the
    engine's context ``limit`` (described by ``limit_text``; ``fix`` says what to change): at setup, not at an
    eval step in the middle of training."""
    e = cfg.eval
    max_new = e.max_new_tokens or cfg.data.max_response_length
    cap = (f"eval.max_new_tokens={max_new}" if e.max_new_tokens else
           f"data.max_response_length={max_new} (eval.max_new_tokens is null)")
    for entry in e.benchmarks:
        name, records, prompts = benchmark_prompts(entry, tokenizer, cfg, num_samples=e.num_problems)
        for i, (record, prompt) in enumerate(zip(records, prompts)):
            if len(prompt) + max_new > limit:
                raise ValueError(
                    f"eval.benchmarks {name!r} problem {i} (uid {record.uid}) has {len(prompt)} prompt tokens: "
                    f"with {cap}, {len(prompt)} + {max_new} = {len(prompt) + max_new} > {limit_text}; {fix}")


def _generate(rollouts, prompts, sampling, cfg, info, *, progress: bool, desc: str):
    from mcpo_megatron.rollout.engines.interface import RolloutOutput

    if not progress:
        return rollouts.generate(prompts, sampling)
    from tqdm import tqdm

    replicas = max(1, info.world_size // cfg.rollout.tensor_parallel_size)
    piece = max(1, cfg.rollout.generation_batch_size * replicas // sampling.n)
    parts = []
    with tqdm(total=len(prompts), desc=desc, unit="prompt", disable=info.rank != 0, dynamic_ncols=True) as bar:
        for start in range(0, len(prompts), piece):
            chunk = prompts[start:start + piece]
            parts.append(rollouts.generate(chunk, sampling, first_index=start))
            bar.update(len(chunk))
    return RolloutOutput.concat(parts)
