"""The engine / trainer numerics contract: the engine's log-probs of its own samples against the policy's log-probs
of the same tokens at the same temperature (max and mean |diff|, k3 KL(engine || trainer))."""

from __future__ import annotations

import torch

from mcpo_megatron.algorithms.kl import k3
from mcpo_megatron.models.batch import SequenceBatch


def policy_contract_figures(policy, prompts: list[list[int]], out) -> dict:
    """:func:`contract_figures` of the engine's samples ``out`` against ``policy``'s own log-probs of
    them (``prompts`` indexed by each sample's ``prompt_index``)."""
    batch = SequenceBatch(
        input_ids=[torch.tensor(prompts[s.prompt_index] + s.token_ids, dtype=torch.long) for s in out],
        prompt_lens=torch.tensor([len(prompts[s.prompt_index]) for s in out], dtype=torch.long),
        response_lens=torch.tensor([len(s.token_ids) for s in out], dtype=torch.long),
    )
    trainer_logps, _ = policy.compute_logprobs(batch, compute_entropy=False)
    return contract_figures(out.logprobs, trainer_logps)


def contract_figures(engine_logps, trainer_logps) -> dict:
    """max / mean |engine - trainer| over all response tokens and the mean k3 estimate of
    KL(engine || trainer) (:func:`mcpo_megatron.algorithms.kl.k3` of log p_trainer - log p_engine at the
    tokens the engine sampled)."""
    e = torch.cat([torch.as_tensor(x, dtype=torch.float64) for x in engine_logps])
    t = torch.cat([torch.as_tensor(x, dtype=torch.float64) for x in trainer_logps])
    if e.shape != t.shape:
        raise ValueError(f"engine has {e.numel()} response tokens, trainer {t.numel()}")
    diff = (e - t).abs()
    return {"tokens": int(e.numel()), "max_abs_diff": float(diff.max()), "mean_abs_diff": float(diff.mean()),
            "k3_kl": float(k3(t - e).mean())}
