"""``mcpo check-model``: load a HF model into Megatron at a TP x PP layout and prove it is the same model.

Run under torchrun (``tp * pp`` processes, or a multiple for data parallel)::

    torchrun --nproc_per_node=2 -m mcpo_megatron.models.check --model builtin:smollm2-135m-instruct --tp 2

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

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
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
    parts = ["torchrun", f"--nproc_per_node={args.tp * args.pp * ep}", "-m", "mcpo_megatron.models.check",
             "--model", args.model, "--tp", str(args.tp), "--pp", str(args.pp), "--dtype", args.dtype]
    if ep != 1:
        parts += ["--ep", str(ep)]
    if vpp != 1:
        parts += ["--vpp", str(vpp)]
    if args.tol is not None:
        parts += ["--tol", str(args.tol)]
    return shlex.join(parts)


def probe_ids(vocab_size: int, batch: int, seq_len: int, seed: int) -> torch.Tensor:
    """Deterministic random token ids [batch, seq_len] (same on every rank)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, seq_len), generator=gen)


def hf_reference_logits(hf_dir: str, input_ids: torch.Tensor) -> torch.Tensor:
    """transformers logits [b, s, V] in fp32 (call before the CPU shim is applied)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids).logits.float()


def megatron_logits(model_chunks, input_ids: torch.Tensor) -> torch.Tensor | None:
    """Full-vocabulary logits [b, s, V] of ``input_ids`` on the last pipeline stage, None elsewhere.

    Runs megatron's forward-only schedule and gathers the vocab-parallel logits over TP
    (only for checks; training keeps them sharded).  ``model_chunks``: a model or this
    rank's list of chunks; with a virtual pipeline the probe runs as PP identical
    micro-batches (the interleaved schedule needs a multiple of PP) and the first is kept.
    With sequence parallelism the probe length must be a multiple of TP.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    device = next(chunks[0].parameters()).device
    ids = input_ids.to(device)
    b, s = ids.shape
    pos = torch.arange(s, device=device).unsqueeze(0).expand(b, s)
    n_mb = ps.get_pipeline_model_parallel_world_size() if len(chunks) > 1 else 1

    def step(_data_iterator, m):
        out = m(ids, pos, None)

        def collect(output, non_loss_data=True):
            return gather_from_tensor_model_parallel_region(output).float()

        return out, collect

    for m in chunks:
        if len(chunks) > 1 and ps.get_pipeline_model_parallel_world_size() == 2:
            m.config.batch_p2p_comm = False  # see models.policy: the two directions to one neighbour
        m.eval()
    with torch.no_grad():
        store = get_forward_backward_func()(
            forward_step_func=step, data_iterator=[iter([None] * n_mb) for _ in chunks] if len(chunks) > 1
            else iter([None]), model=chunks, num_microbatches=n_mb,
            seq_length=s, micro_batch_size=b, forward_only=True, collect_non_loss_data=True,
        )
    if ps.is_pipeline_last_stage(ignore_virtual=True):
        return store[0].cpu()
    return None


def logit_stats(ours: torch.Tensor, ref: torch.Tensor, input_ids: torch.Tensor) -> dict:
    """max/mean |logit diff| and |log-prob diff| of the next tokens (position t predicts token t+1)."""
    diff = (ours.double() - ref.double()).abs()
    targets = input_ids[:, 1:].unsqueeze(-1)
    lp_ours = torch.log_softmax(ours.double(), -1)[:, :-1].gather(-1, targets)
    lp_ref = torch.log_softmax(ref.double(), -1)[:, :-1].gather(-1, targets)
    lp_diff = (lp_ours - lp_ref).abs()
    return {
        "max_abs_logit_diff": diff.max().item(),
        "mean_abs_logit_diff": diff.mean().item(),
        "max_abs_logprob_diff": lp_diff.max().item(),
        "mean_abs_logprob_diff": lp_diff.mean().item(),
        "max_abs_ref_logit": ref.abs().max().item(),
    }


def compare_checkpoints(original_dir: str, exported_dir: str, dtype: torch.dtype) -> dict:
    """Compare every tensor of two HF checkpoints; the original is cast to ``dtype`` first."""
    from mcpo_megatron.models.hf_io import SafetensorsReader

    a, b = SafetensorsReader(original_dir), SafetensorsReader(exported_dir)
    names_a, names_b = set(a.weight_map), set(b.weight_map)
    mismatched = []
    max_diff = 0.0
    for name in sorted(names_a & names_b):
        x, y = a.full(name).to(dtype), b.full(name)
        if x.shape != y.shape or x.dtype != y.dtype or not torch.equal(x, y):
            mismatched.append(name)
            if x.shape == y.shape:
                max_diff = max(max_diff, (x.double() - y.double()).abs().max().item())
    a.close()
    b.close()
    return {
        "tensors_compared": len(names_a & names_b),
        "missing_in_export": sorted(names_a - names_b),
        "extra_in_export": sorted(names_b - names_a),
        "mismatched": mismatched,
        "max_abs_weight_diff": max_diff,
    }


def run(args: argparse.Namespace) -> int:
    """Entry point of ``mcpo check-model``; returns the exit status."""
    if "RANK" not in os.environ and "SLURM_PROCID" not in os.environ:
        print("check-model runs one process per rank; start it with:\n\n  " + torchrun_command(args) + "\n",
              file=sys.stderr)
        return 2
    from transformers import AutoConfig

    from mcpo_megatron.models.sources import resolve_model_path

    hf_dir = resolve_model_path(args.model)
    hf_config = AutoConfig.from_pretrained(hf_dir)
    dtype = DTYPES[args.dtype]
    tol = args.tol if args.tol is not None else DEFAULT_TOL[args.dtype]
    ids = probe_ids(hf_config.vocab_size, args.batch, args.seq_len, args.seed)
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
    # The reference runs before init_distributed: transformers must not see the CPU shim.
    ref = hf_reference_logits(hf_dir, ids) if rank == 0 else None

    from mcpo_megatron.models.builder import build_model_chunks
    from mcpo_megatron.models.hf_io import export_hf, load_hf_weights
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
        export_hf(model, hf_config, export_dir, tokenizer_dir=hf_dir, dtype=dtype)
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="mcpo check-model", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    _add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
