"""``mcpo check-model``: load a HF model into Megatron at a TP x PP layout and prove it is the same model.

Run under torchrun (``tp * pp`` processes, or a multiple for data parallel)::

    torchrun --nproc_per_node=2 -m mcpo_megatron.cli check-model --model builtin:smollm2-135m-instruct --tp 2

Steps: rank 0 runs a probe batch through transformers (fp32, before any
process group exists); every rank builds the Megatron model, loads the HF
weights (its slices only) and runs the probe through Megatron's forward-only
pipeline schedule; the last stage gathers the vocab-parallel logits (fine for a
check, training never does this) and rank 0 prints max / mean |logit diff| and
|log-prob diff| of the probe's next tokens.  Then the model is exported to a
temporary HF directory and every tensor is compared with the original
checkpoint (bit-exact when the model dtype can hold the checkpoint's values).
Exit status 0 when everything is within tolerance, 1 otherwise, 2 when started
without torchrun/srun.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
from pathlib import Path

import torch

from mcpo_megatron.models.parity import (
    DTYPES,
    compare_checkpoints,
    hf_reference_logits,
    logit_stats,
    megatron_logits,
    probe_ids,
)

# bf16 against the fp32 reference: SmolLM2-135M at TP=2 measures max |logit diff| ~1.0 (max |logit| 33.5),
# while a wrong weight mapping moves logits by about their own scale; fp32 is the tight check.
DEFAULT_TOL = {"float32": 1e-3, "bfloat16": 2.0}


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``check-model`` on an argparse subparsers object."""
    p = subparsers.add_parser(
        "check-model",
        help="load a HF model into Megatron at TP x PP and compare logits and weights with transformers",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_arguments(p)
    p.set_defaults(func=run)
    return p


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True,
                   help="HF directory, 'builtin:smollm2-135m-instruct' or a hub id 'org/name'")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (default 1)")
    p.add_argument("--ep", type=int, default=1,
                   help="expert-parallel size of a mixture-of-experts model (default 1; needs tp*pp*ep processes)")
    p.add_argument("--vpp", type=int, default=1, help="virtual pipeline size (interleaving; default 1)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                   help="Megatron parameter dtype (default float32; the reference is always fp32)")
    p.add_argument("--tol", type=float, default=None,
                   help="max |logit diff| allowed (default 1e-3 for float32, 2.0 for bfloat16)")
    p.add_argument("--batch", type=int, default=2, help="probe sequences (default 2)")
    p.add_argument("--seq-len", type=int, default=16, help="probe tokens per sequence (default 16)")
    p.add_argument("--seed", type=int, default=0, help="probe token seed (default 0)")
    p.add_argument("--transformer-impl", default="auto", choices=["auto", "local", "transformer_engine"],
                   help="layer implementation (default auto: TE on GPUs when installed)")
    p.add_argument("--dump", default=None,
                   help="directory to write probe ids, Megatron logits and the summary JSON into")


def torchrun_command(args: argparse.Namespace) -> str:
    """The command line that runs this check under torchrun with ``tp * pp`` processes."""
    ep, vpp = getattr(args, "ep", 1), getattr(args, "vpp", 1)
    parts = ["torchrun", f"--nproc_per_node={args.tp * args.pp * ep}", "-m", "mcpo_megatron.cli", "check-model",
             "--model", args.model, "--tp", str(args.tp), "--pp", str(args.pp), "--dtype", args.dtype]
    if ep != 1:
        parts += ["--ep", str(ep)]
    if vpp != 1:
        parts += ["--vpp", str(vpp)]
    if args.tol is not None:
        parts += ["--tol", str(args.tol)]
    return shlex.join(parts)


def run(args: argparse.Namespace) -> int:
    """Entry point of ``mcpo check-model``; returns the exit status."""
    from mcpo_megatron.parallel.distributed import under_launcher
    from mcpo_megatron.parallel.launcher import launcher_env

    if not under_launcher():
        print("check-model runs one process per rank; start it with:\n\n  " + torchrun_command(args) + "\n",
              file=sys.stderr)
        return 2
    from mcpo_megatron.models.multimodal import load_language_model_config
    from mcpo_megatron.models.sources import resolve_model_path

    hf_dir = resolve_model_path(args.model)
    hf_config = load_language_model_config(hf_dir)
    dtype = DTYPES[args.dtype]
    tol = args.tol if args.tol is not None else DEFAULT_TOL[args.dtype]
    ids = probe_ids(hf_config.vocab_size, args.batch, args.seq_len, args.seed)
    rank = launcher_env()[0]
    # The reference runs before init_distributed: transformers must not see the CPU shim.
    ref = hf_reference_logits(hf_dir, ids) if rank == 0 else None

    from mcpo_megatron.models.builder import build_model_chunks
    from mcpo_megatron.models.hf_export import export_hf
    from mcpo_megatron.models.hf_io import load_hf_weights
    from mcpo_megatron.parallel.distributed import (
        all_gather_objects, broadcast_object, destroy_distributed, init_distributed,
    )

    info = init_distributed(args.tp, args.pp, seed=args.seed, ep=args.ep, vpp=args.vpp)
    try:
        model = build_model_chunks(hf_config, dtype=dtype, transformer_impl=args.transformer_impl,
                                   config_overrides={"perform_initialization": False})
        load_hf_weights(model, hf_dir)
        logits = megatron_logits(model, ids)
        keep = info.is_last_stage and info.tp_rank == 0 and info.dp_rank == 0
        gathered = all_gather_objects(logits if keep else None)
        summary = {"model": args.model, "tp": args.tp, "pp": args.pp, "ep": args.ep, "vpp": args.vpp, "dp": info.dp,
                   "dtype": args.dtype, "tol": tol}
        if rank == 0:
            ours = next(t for t in gathered if t is not None)
            summary.update(logit_stats(ours, ref, ids))
            print(f"check-model {args.model} tp={args.tp} pp={args.pp} ep={args.ep} vpp={args.vpp} dtype={args.dtype}")
            print(f"  max |logit diff|   {summary['max_abs_logit_diff']:.3e}   "
                  f"mean {summary['mean_abs_logit_diff']:.3e}   (max |logit| {summary['max_abs_ref_logit']:.2f})")
            print(f"  max |logprob diff| {summary['max_abs_logprob_diff']:.3e}   "
                  f"mean {summary['mean_abs_logprob_diff']:.3e}")
        export_root = broadcast_object(tempfile.mkdtemp(prefix="mcpo-check-") if rank == 0 else None, src=0)
        export_dir = os.path.join(export_root, "export")
        export_hf(model, hf_config, export_dir, tokenizer_dir=hf_dir, dtype=dtype, source_dir=hf_dir)
        ok = True
        if rank == 0:
            cmp = compare_checkpoints(hf_dir, export_dir, dtype)
            summary["export"] = cmp
            print(f"  export: {cmp['tensors_compared']} tensors compared, {len(cmp['mismatched'])} mismatched, "
                  f"{len(cmp['missing_in_export'])} missing, {len(cmp['extra_in_export'])} extra")
            ok = (summary["max_abs_logit_diff"] <= tol and not cmp["mismatched"]
                  and not cmp["missing_in_export"] and not cmp["extra_in_export"])
            summary["ok"] = ok
            print("  OK" if ok else f"  FAILED (tolerance {tol:g} on |logit diff|; exported weights must match)")
            if args.dump:
                dump = Path(args.dump)
                dump.mkdir(parents=True, exist_ok=True)
                torch.save({"input_ids": ids, "logits": ours}, dump / "megatron_logits.pt")
                (dump / "summary.json").write_text(json.dumps(summary, indent=2))
            import shutil

            shutil.rmtree(export_root, ignore_errors=True)
        ok = broadcast_object(ok, src=0)
    finally:
        destroy_distributed()
    return 0 if ok else 1
