"""``mcpo export --checkpoint DIR --out HF_DIR``: a training checkpoint to Hugging Face safetensors.

The policy is rebuilt from the checkpoint's own ``config.yaml`` at its training TP x PP, on TP x PP ranks, one per
GPU: launched so (srun or torchrun with TP x PP ranks; ``slurm/export.sbatch`` sizes its job step with
``--print-ranks``), or started as one process, which starts them itself under torchrun on this machine (where
TP x PP GPUs are visible). A launch of any other size is refused. The training layout is kept because the
weights' global shapes depend on TP when attention heads are padded (``num_key_value_heads`` not divisible by
TP: megatron is built with the query groups rounded up to a multiple of TP, so a smaller TP cannot read them),
and because the policy is built with its training buffers, whose memory per GPU is what training fitted.
Expert parallelism and interleaving are dropped (megatron's distributed checkpoint holds every expert and layer
under global indices, so any EP / virtual pipeline size loads it). The export is written with config,
generation config and tokenizer, then re-loaded with transformers: its log-probs on a probe batch must equal
the Megatron model's, or the command fails loudly and removes nothing it did not write.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

PROBE_TEXTS = (
    "What is 17 + 25? Think step by step.",
    "The derivative of x^3 is",
    "Solve for x: 2x + 3 = 11. Answer:",
)


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "export", help="export a training checkpoint to Hugging Face safetensors",
        description="Export a checkpoint (a step_N directory, or a checkpoints/ directory: its latest) to a "
                    "Hugging Face model directory, then verify it against the Megatron model. It runs at the "
                    "checkpoint's training TP x PP, one rank per GPU: under a launcher with TP x PP ranks, or "
                    "started as one process, which starts them with torchrun on this machine (TP x PP GPUs must be "
                    "visible). sbatch slurm/export.sbatch does this on a cluster.",
        epilog="example: mcpo export --checkpoint runs/demo_mcpo/checkpoints --out exports/demo_mcpo")
    p.add_argument("--checkpoint", required=True, help="step_N checkpoint directory, or its parent (uses latest)")
    p.add_argument("--out", required=True, help="output directory (must not exist, or be empty)")
    p.add_argument("--dtype", choices=("fp32", "bf16", "auto"), default="auto",
                   help="dtype of the exported weights (auto: the training dtype)")
    p.add_argument("--tol", type=float, default=None,
                   help="max |log-prob diff| allowed in the parity check (default 1e-4 fp32, 5e-2 bf16)")
    p.add_argument("--print-ranks", action="store_true",
                   help="print the number of ranks the export runs on (the checkpoint's TP x PP, one per GPU) and "
                        "exit; slurm/export.sbatch sizes its job step with it")
    return p


def run(args) -> int:
    import torch

    from mcpo_megatron.config import load_config
    from mcpo_megatron.models.hf_io import export_hf
    from mcpo_megatron.parallel import distributed
    from mcpo_megatron.trainer.checkpoint import resolve_checkpoint
    from mcpo_megatron.trainer.components import build_policy, resolve_model_dir

    try:
        ckpt = resolve_checkpoint(args.checkpoint)
    except FileNotFoundError as e:
        print(f"error: --checkpoint {e}", file=sys.stderr)
        return 1
    cfg = load_config(str(ckpt / "config.yaml"))
    if args.dtype != "auto":
        cfg.model.dtype = args.dtype
    cfg.parallelism.expert_model_parallel_size = 1  # one process per TP x PP rank: no data parallelism
    cfg.parallelism.virtual_pipeline_model_parallel_size = None
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
                *(["--tol", str(args.tol)] if args.tol is not None else [])]
        return distributed.run_under_torchrun(["export", *argv], tp * pp)
    info = distributed.init_distributed(tp, pp, seed=cfg.trainer.seed)
    try:
        model_dir = resolve_model_dir(cfg, info)
        policy = build_policy(cfg, model_dir, info, load_weights=False)
        policy.load_checkpoint(ckpt / "policy", load_optimizer=False)
        if info.rank == 0:
            print(f"loaded {ckpt} (TP={tp}, PP={pp}); exporting to {out}", flush=True)
        export_hf(policy.model_chunks, policy.hf_config, str(out), tokenizer_dir=model_dir)
        distributed.barrier()
        worst = probe_parity(policy, str(out), model_dir, cfg.rollout.temperature, compare=info.rank == 0)
    finally:
        distributed.destroy_distributed()
    if info.rank != 0:
        return 0
    tol = args.tol if args.tol is not None else (1e-4 if policy.dtype == torch.float32 else 5e-2)
    print(f"parity: max |log-prob diff| Megatron vs exported transformers model = {worst:.3e} (tolerance {tol:g})")
    if not worst <= tol:
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
    import torch

    from mcpo_megatron.parallel.distributed import launcher_env

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


def probe_parity(policy, export_dir: str, tokenizer_dir: str, temperature: float, *, compare: bool = True) -> float:
    """Max |log-prob diff| on a probe batch: Megatron policy vs the export loaded by transformers.

    Every rank runs the (collective) Megatron forward; only ranks with ``compare`` load the export."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mcpo_megatron.models.batch import SequenceBatch

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = [torch.tensor(tok(t, add_special_tokens=False)["input_ids"], dtype=torch.long) for t in PROBE_TEXTS]
    prompt = 3  # score every token after the first three
    batch = SequenceBatch(input_ids=ids, prompt_lens=torch.full((len(ids),), prompt),
                          response_lens=torch.tensor([len(x) - prompt for x in ids]))
    ours, _ = policy.compute_logprobs(batch, compute_entropy=False)
    if not compare:
        return 0.0
    hf = AutoModelForCausalLM.from_pretrained(export_dir, dtype=policy.dtype)
    worst = 0.0
    with torch.no_grad():
        for x, mine in zip(ids, ours):
            logits = hf(x.unsqueeze(0)).logits[0].float() / temperature
            ref = torch.log_softmax(logits, -1)[prompt - 1:-1].gather(-1, x[prompt:, None])[:, 0]
            worst = max(worst, float((ref - mine.float()).abs().max()))
    return worst

