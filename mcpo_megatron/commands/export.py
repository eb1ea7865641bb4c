"""``mcpo export --checkpoint DIR --out HF_DIR``: a training checkpoint to Hugging Face safetensors.

The model is rebuilt from the checkpoint's own ``config.yaml`` at its training TP x PP, on TP x PP ranks, one per
GPU: launched so (srun or torchrun with TP x PP ranks; ``slurm/export.sbatch`` sizes its job step with
``--print-ranks``), or started as one process, which starts them itself under torchrun on this machine (where
TP x PP GPUs are visible). A launch of any other size is refused. The training layout is kept because the
weights' global shapes depend on TP when attention heads are padded (``num_key_value_heads`` not divisible by
TP: megatron is built with the query groups rounded up to a multiple of TP, so a smaller TP cannot read them).
Expert parallelism and interleaving are dropped (megatron's distributed checkpoint holds every expert and layer
under global indices, so any EP / virtual pipeline size loads it): every rank holds 1 / TP of every expert of its
pipeline stage.

Each rank builds only its bare model chunks, in fp32, and loads the checkpoint's model weights into them (no
gradient buffers, optimizer or optimizer state; a bf16 checkpoint loads exactly). GPU memory per rank: 4 bytes per
parameter of its shard (Qwen3-30B-A3B at TP=2: ~61 GB; Qwen3-32B at TP=8: ~16 GB). The export is written in
``--dtype`` (auto: the training dtype; fp32 -> bf16 of a bf16 checkpoint's values is exact) with config,
generation config and tokenizer, into a temporary directory renamed at the end.

Parity check: the Megatron model's log-probs on three probe texts must equal those of the export loaded by
transformers, both in fp32 (in bf16, rounding noise alone flips some tokens' top-k experts between the two
implementations of a mixture-of-experts model, whatever the export), within ``--tol`` (1e-4); the weights are
first rounded to the export's dtype, so the probe sees what the export holds. The transformers model is loaded on
the CPU of one rank (last pipeline stage, TP rank 0): 4 bytes per parameter of host memory (Qwen3-32B: ~131 GB);
``--no-parity`` skips the check where that does not fit. Every rank exits with the verdict's code.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

PROBE_TEXTS = (
    "What is 17 + 25? Think step by step.",
    "The derivative of x^3 is",
    "Solve for x: 2x + 3 = 11. Answer:",
)
DEFAULT_TOL = 1e-4  # max |log-prob diff| of the parity probe, fp32 against fp32
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16"}


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "export", help="export a training checkpoint to Hugging Face safetensors",
        description="Export a checkpoint (a step_N directory, or a checkpoints/ directory: its latest) to a "
                    "Hugging Face model directory, then verify it against the Megatron model. It runs at the "
                    "checkpoint's training TP x PP, one rank per GPU: under a launcher with TP x PP ranks, or "
                    "started as one process, which starts them with torchrun on this machine (TP x PP GPUs must be "
                    "visible). sbatch slurm/export.sbatch does this on a cluster. Memory: each GPU holds its shard "
                    "of the model in fp32 (4 bytes per parameter: Qwen3-30B-A3B at TP=2 ~61 GB, Qwen3-32B at TP=8 "
                    "~16 GB; no optimizer); the parity check loads the whole export in fp32 on one rank's CPU "
                    "(4 bytes per parameter of host memory: Qwen3-32B ~131 GB; --no-parity skips it).",
        epilog="example: mcpo export --checkpoint runs/demo_mcpo/checkpoints --out exports/demo_mcpo")
    p.add_argument("--checkpoint", required=True, help="step_N checkpoint directory, or its parent (uses latest)")
    p.add_argument("--out", required=True, help="output directory (must not exist, or be empty)")
    p.add_argument("--dtype", choices=("fp32", "bf16", "auto"), default="auto",
                   help="dtype of the exported weights (auto: the training dtype, model.dtype of the checkpoint)")
    p.add_argument("--tol", type=float, default=None,
                   help=f"max |log-prob diff| allowed in the parity check, which runs in fp32 on both sides "
                        f"(default {DEFAULT_TOL:g})")
    p.add_argument("--no-parity", dest="parity", action="store_false",
                   help="skip the parity check (it needs 4 bytes per parameter of host memory on one rank for the "
                        "transformers model: ~131 GB for Qwen3-32B)")
    p.add_argument("--print-ranks", action="store_true",
                   help="print the number of ranks the export runs on (the checkpoint's TP x PP, one per GPU) and "
                        "exit; slurm/export.sbatch sizes its job step with it")
    return p


def run(args) -> int:
    from mcpo_megatron.config import load_config
    from mcpo_megatron.models.hf_export import export_hf
    from mcpo_megatron.models.multimodal import load_language_model_config
    from mcpo_megatron.models.policy_checkpoint import load_model_weights
    from mcpo_megatron.parallel import distributed
    from mcpo_megatron.trainer.checkpoint import resolve_checkpoint
    from mcpo_megatron.trainer.components import resolve_model_dir

    try:
        ckpt = resolve_checkpoint(args.checkpoint)
    except FileNotFoundError as e:
        print(f"error: --checkpoint {e}", file=sys.stderr)
        return 1
    cfg = load_config(str(ckpt / "config.yaml"))
    cfg.parallelism.expert_model_parallel_size = 1  # one process per TP x PP rank: no data parallelism
    cfg.parallelism.virtual_pipeline_model_parallel_size = None
    cfg.parallelism.context_parallel_size = 1  # the weights do not depend on how sequences were split
    tp, pp = cfg.parallelism.tensor_model_parallel_size, cfg.parallelism.pipeline_model_parallel_size
    trained = f"{ckpt} was trained at TP={tp} x PP={pp}"
    if args.print_ranks:
        print(f"{trained}: the export runs {tp * pp} rank(s), one per GPU", file=sys.stderr)
        print(tp * pp)
        return 0
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        print(f"error: --out {out} exists and is not empty; choose a new directory", file=sys.stderr)
        return 1
    try:
        start_ranks = needs_own_ranks(tp * pp, trained)
    except LaunchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if start_ranks:
        argv = ["--checkpoint", str(args.checkpoint), "--out", str(args.out), "--dtype", args.dtype,
                *(["--tol", str(args.tol)] if args.tol is not None else []),
                *([] if args.parity else ["--no-parity"])]
        return distributed.run_under_torchrun(["export", *argv], tp * pp)
    info = distributed.init_distributed(tp, pp, seed=cfg.trainer.seed)
    try:
        model_dir = resolve_model_dir(cfg, info)
        hf_config = load_language_model_config(model_dir)
        chunks = build_fp32_chunks(cfg, hf_config, info)
        load_model_weights(chunks, ckpt / "policy")
        dtype = export_dtype(args.dtype, cfg, info.device)
        if info.rank == 0:
            print(f"loaded {ckpt} (TP={tp}, PP={pp}) in fp32; exporting to {out} in {DTYPE_NAMES[dtype]}", flush=True)
        export_hf(chunks, hf_config, str(out), tokenizer_dir=model_dir, dtype=dtype, source_dir=model_dir)
        distributed.barrier()
        worst = None
        if args.parity:
            round_weights(chunks, dtype)
            holds_logits = info.is_last_stage and info.tp_rank == 0
            mine = probe_parity(chunks, str(out), model_dir, compare=holds_logits)
            # the comparing rank's verdict, on every rank (a pickled float: CPU, gloo)
            worst = next(w for w in distributed.all_gather_objects(mine) if w is not None)
    finally:
        distributed.destroy_distributed()
    return report_parity(worst, args.tol if args.tol is not None else DEFAULT_TOL, out, quiet=info.rank != 0)


def build_fp32_chunks(cfg, hf_config, info) -> list:
    """This rank's bare model chunks in fp32, as training builds them but without DDP, gradient buffers or
    optimizer; their weights are left for :func:`~mcpo_megatron.models.policy_checkpoint.load_model_weights`."""
    from mcpo_megatron.models.builder import build_model_chunks

    return build_model_chunks(hf_config, dtype=torch.float32, transformer_impl=cfg.model.transformer_impl,
                              config_overrides={"perform_initialization": False},
                              sequence_parallel=cfg.parallelism.sequence_parallel and info.tp > 1)


def export_dtype(choice: str, cfg, device) -> torch.dtype:
    """``--dtype``: fp32, bf16, or auto: the training dtype (the checkpoint's ``model.dtype``)."""
    from mcpo_megatron.trainer.components import torch_dtype

    if choice == "auto":
        return torch_dtype(cfg, device)
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[choice]


@torch.no_grad()
def round_weights(chunks: list, dtype: torch.dtype) -> None:
    """Round the fp32 weights to the export's dtype in place, so the parity probe runs on the weights the export
    holds. A no-op for a bf16 checkpoint exported in bf16 (its values are bf16 already) and for fp32."""
    if dtype == torch.float32:
        return
    for chunk in chunks:
        for p in chunk.parameters():
            p.copy_(p.to(dtype))


def report_parity(worst: float | None, tol: float, out: Path, *, quiet: bool) -> int:
    """Print the parity verdict (rank 0 only) and return the exit code (every rank the same)."""
    ok = worst is None or worst <= tol
    if quiet:
        return 0 if ok else 1
    if worst is None:
        print("parity check skipped (--no-parity): the export was not compared with the Megatron model")
    else:
        print(f"parity: max |log-prob diff| Megatron vs exported transformers model = {worst:.3e} "
              f"(fp32 on both sides, tolerance {tol:g})")
    if not ok:
        print(f"error: exported model does not reproduce the checkpoint (max diff {worst:.3e} > {tol:g})",
              file=sys.stderr)
        return 1
    print(f"exported {out}")
    return 0


class LaunchError(ValueError):
    """The launch does not give the export one rank per GPU of the checkpoint's layout."""


def needs_own_ranks(ranks: int, why: str) -> bool:
    """Whether this process must start the export's ``ranks`` ranks itself (torchrun on this machine): True for a
    single process when ``ranks`` > 1, False when the launch already has ``ranks`` ranks. Raises
    :class:`LaunchError` for a launch of another size, and for a single process that sees fewer CUDA devices than
    ``ranks`` (its ranks would share a GPU, which NCCL refuses: "Duplicate GPU detected")."""
    from mcpo_megatron.parallel.launcher import launcher_env

    world = launcher_env()[1]
    if world == ranks:
        return False
    if world != 1:
        raise LaunchError(f"{why}: `mcpo export` runs on {ranks} ranks, one per GPU, but this launch has {world}; "
                          f"launch {ranks} ranks (sbatch slurm/export.sbatch sizes its job step from the checkpoint), "
                          f"or start `mcpo export` as one process where {ranks} GPUs are visible (it starts torchrun "
                          "itself)")
    if torch.cuda.is_available() and torch.cuda.device_count() < ranks:
        raise LaunchError(f"{why}: `mcpo export` runs on {ranks} ranks, one per GPU, but this process sees "
                          f"{torch.cuda.device_count()} GPU(s); run it where {ranks} GPUs are visible (sbatch "
                          f"slurm/export.sbatch), or under a launcher with {ranks} ranks")
    return True


def probe_parity(chunks: list, export_dir: str, tokenizer_dir: str, *, compare: bool) -> float | None:
    """Max |log-prob diff| of every next token of :data:`PROBE_TEXTS`: the Megatron chunks vs the export loaded by
    transformers, both in fp32 (in bf16, rounding noise alone flips some tokens' top-k experts between the two
    implementations of a mixture-of-experts model).

    Every rank runs megatron's forward (collective), one probe text per call; the rank with ``compare`` (one that
    holds the full logits: last pipeline stage, TP rank 0) loads the export on its CPU and returns the difference,
    the others None."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mcpo_megatron.models.parity import logit_stats, megatron_logits

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    probes = [torch.tensor([tok(t, add_special_tokens=False)["input_ids"]], dtype=torch.long) for t in PROBE_TEXTS]
    config = chunks[0].config
    # Sequence parallelism splits the sequence over TP: pad the probe to a multiple (causal attention keeps the
    # padding out of the real positions' logits, and dropless routing decides token by token).
    multiple = config.tensor_model_parallel_size if config.sequence_parallel else 1
    ours = [megatron_logits(chunks, torch.nn.functional.pad(ids, (0, -ids.shape[1] % multiple))) for ids in probes]
    if not compare:
        return None
    hf = AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        diffs = [logit_stats(mine[:, : ids.shape[1]], hf(ids).logits.float(), ids)["max_abs_logprob_diff"]
                 for ids, mine in zip(probes, ours)]
    return float(torch.tensor(diffs).max())  # NaN stays NaN (Python's max would drop it)
