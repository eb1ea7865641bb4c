"""Is the Megatron model the Hugging Face model? Probe inputs, the logits of both, their differences, and a
tensor-by-tensor comparison of an exported checkpoint with the original (``mcpo check-model``, ``mcpo selftest``
and the parity tests use these)."""

from __future__ import annotations

import torch


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
def probe_ids(vocab_size: int, batch: int, seq_len: int, seed: int) -> torch.Tensor:
    """Deterministic random token ids [batch, seq_len] (same on every rank)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, seq_len), generator=gen)


def hf_reference_logits(hf_dir: str, input_ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """transformers logits [b, s, V], the model run in ``dtype`` (call before the CPU shim is applied)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).eval()
    with torch.no_grad():
        return model(input_ids).logits.to(torch.promote_types(dtype, torch.float32))


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
            m.config.batch_p2p_comm = False  # see models.passes: the two directions to one neighbour
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
    """Compare every tensor of two HF checkpoints; the original is cast to ``dtype`` first, except a multimodal
    checkpoint's tensors outside its language model (vision tower, ``mtp.*``), which the export copies as they
    are stored."""
    from mcpo_megatron.models.hf_io import SafetensorsReader
    from mcpo_megatron.models.multimodal import is_multimodal_dir, untrained_names

    a, b = SafetensorsReader(original_dir), SafetensorsReader(exported_dir)
    names_a, names_b = set(a.weight_map), set(b.weight_map)
    as_stored = set(untrained_names(names_a)) if is_multimodal_dir(original_dir) else set()
    mismatched = []
    max_diff = 0.0
    for name in sorted(names_a & names_b):
        x, y = a.full(name), b.full(name)
        x = x if name in as_stored else x.to(dtype)
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
