"""Shared by the policy worker (under torchrun) and the pytest side: the probe batch and the MCPO loss.

The batch and its global loss weights are built from a seed, so the worker and the
single-process reference see the same data.  ``old_logp`` is not known in advance: the
worker computes the policy's own log-probs and perturbs them (``perturb_old_logp``) so the
PPO clip and the hinge-KL are active on a good share of tokens; it writes the result out
for the reference.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mcpo_megatron.algorithms.losses import LossInputs, LossSettings, local_counts, policy_loss, token_weights
from mcpo_megatron.models.batch import SequenceBatch

TEMPERATURE = 0.7
HINGE_DELTA = 0.01
ENTROPY_COEFF = 0.01
PROMPT_LENS = [3, 6, 2, 8, 5, 4, 7, 3]
RESPONSE_LENS = [9, 4, 7, 0, 10, 5, 3, 8]
MASTERED = [True, False, True, False, True, True, False, False]


def make_batch(vocab: int, seed: int = 0, prompt_lens=PROMPT_LENS, response_lens=RESPONSE_LENS,
               mastered=MASTERED) -> SequenceBatch:
    """Random sequences of the given prompt/response lengths (by default 8 short ones, one empty response), with
    advantages and mastery."""
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(3, vocab, (p + r,), generator=g) for p, r in zip(prompt_lens, response_lens)]
    adv = torch.randn(len(ids), generator=g, dtype=torch.float64) * 1.5
    return SequenceBatch(
        input_ids=ids,
        prompt_lens=torch.tensor(prompt_lens),
        response_lens=torch.tensor(response_lens),
        token_fields={},
        seq_fields={"advantage": adv.float(), "mastered": torch.tensor(mastered)},
    )


def perturb_old_logp(logp: list[torch.Tensor], seed: int = 1) -> list[torch.Tensor]:
    """old_logp = logp + N(0, 0.15^2): ratios leave the clip range and |d| > delta on most tokens."""
    g = torch.Generator().manual_seed(seed)
    return [(x.double() + 0.15 * torch.randn(x.shape, generator=g, dtype=torch.float64)).float() for x in logp]


def padded(values: list[torch.Tensor], width: int, dtype=torch.float64) -> torch.Tensor:
    out = torch.zeros(len(values), width, dtype=dtype)
    for i, v in enumerate(values):
        out[i, : v.numel()] = v.to(dtype)
    return out


def add_weights(batch: SequenceBatch) -> None:
    """Global seq-mean-token-mean PG weights and mastered-mean hinge weights into token_fields."""
    width = int(batch.response_lens.max())
    mask = torch.arange(width)[None, :] < batch.response_lens[:, None]
    mastered = batch.seq_fields["mastered"]
    pg, hk = token_weights(mask, mastered, loss_agg_mode="seq-mean-token-mean",
                           global_counts=local_counts(mask, mastered), dtype=torch.float64)
    lens = batch.response_lens.tolist()
    batch.token_fields["pg_weight"] = [pg[i, :n].float() for i, n in enumerate(lens)]
    batch.token_fields["hkl_weight"] = [hk[i, :n].float() for i, n in enumerate(lens)]


def shard(batch: SequenceBatch, dp_rank: int, dp: int) -> tuple[list[int], SequenceBatch]:
    """Sequences dp_rank, dp_rank + dp, ... (each DP rank its own share)."""
    idx = list(range(dp_rank, len(batch), dp))
    t = torch.tensor(idx)
    return idx, SequenceBatch(
        input_ids=[batch.input_ids[i] for i in idx],
        prompt_lens=batch.prompt_lens[t],
        response_lens=batch.response_lens[t],
        token_fields={k: [v[i] for i in idx] for k, v in batch.token_fields.items()},
        seq_fields={k: v[t] for k, v in batch.seq_fields.items()},
    )


def mcpo_loss(logp, old_logp, advantage, pg_weight, hkl_weight, mask, entropy):
    """The MCPO loss (clip-higher + dual clip + hinge-KL, small entropy bonus) of one [b, T] block."""
    return policy_loss(LossInputs(logp, old_logp, advantage, pg_weight, mask, hkl_weight=hkl_weight, entropy=entropy),
                       LossSettings(hinge_coef=1.0, hinge_delta=HINGE_DELTA, entropy_coeff=ENTROPY_COEFF))


def policy_loss_fn(logp, entropy, mb):
    """The ``loss_fn(logp, entropy, mb)`` handed to ``MegatronPolicy.train_step``."""
    f = mb.token_fields
    return mcpo_loss(logp, f["old_logp"], mb.seq_fields["advantage"], f["pg_weight"], f["hkl_weight"],
                     mb.mask, entropy)


def hf_tensors(policy, use_grad: bool) -> dict[str, torch.Tensor]:
    """Full HF-named parameters (or, with ``use_grad``, their ``main_grad``) of the policy, on every rank
    (a collective: run it on all ranks)."""
    from mcpo_megatron.models.hf_io import iter_hf_tensors

    saved = []
    if not use_grad:
        policy.sync_params()  # a parameter all-gather still pending (overlap_param_gather)
    if use_grad:
        for chunk in policy.model_chunks:
            for p in chunk.parameters():
                saved.append((p, p.data.clone()))
                p.data.copy_(p.main_grad)
    try:
        return {k: v.detach().clone().cpu() for k, v in iter_hf_tensors(policy.model_chunks, policy.hf_config)}
    finally:
        for p, data in saved:
            p.data.copy_(data)


def gather_by_index(idx, values, info, n):
    """Per-sequence values computed on the DP ranks that hold them -> the full list of ``n``, on every rank."""
    from mcpo_megatron.parallel.distributed import all_gather_objects

    out = [None] * n
    for ids, vals in all_gather_objects((idx, values), group=info.dp_group):
        for i, v in zip(ids, vals):
            out[i] = v
    return out


def save_checkpoint(policy, ckpt: Path, rank: int) -> None:
    """Rank 0 creates ``ckpt``, every rank writes its part; returns once the checkpoint is complete."""
    from mcpo_megatron.parallel.distributed import barrier

    if rank == 0:
        ckpt.mkdir(parents=True, exist_ok=True)
    barrier()
    policy.save_checkpoint(ckpt)
    barrier()


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """Largest |a - b| over per-sequence tensors (0 for empty ones)."""
    return max((float((x.double() - y.double()).abs().max()) for x, y in zip(a, b) if x.numel()), default=0.0)


def grad_rel_diff(a: dict, b: dict) -> float:
    """Largest |a - b| of same-named tensors relative to the largest |b| of each."""
    return max(float((a[k].double() - b[k].double()).abs().max() / b[k].double().abs().max().clamp(min=1e-30))
               for k in b)
