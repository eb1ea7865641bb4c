"""The engine / trainer numerics contract: the engine's log-probs of its own samples against the policy's log-probs
of the same tokens at the same temperature (max and mean |diff|, k3 KL(engine || trainer))."""

from __future__ import annotations

import torch

from mcpo_megatron.algorithms.kl import k3
from mcpo_megatron.models.batch import SequenceBatch
from mcpo_megatron.models.routing_replay import RoutingReplay


def policy_contract_figures(policy, prompts: list[list[int]], out) -> dict:
    """:func:`contract_figures` of the engine's samples ``out`` against ``policy``'s own log-probs of
    them (``prompts`` indexed by each sample's ``prompt_index``)."""
    batch = SequenceBatch(
        input_ids=[torch.tensor(prompts[s.prompt_index] + s.token_ids, dtype=torch.long) for s in out],
        prompt_lens=torch.tensor([len(prompts[s.prompt_index]) for s in out], dtype=torch.long),
        response_lens=torch.tensor([len(s.token_ids) for s in out], dtype=torch.long),
    )
    routes = out.routed_experts
    replay = getattr(policy, "routing", None)
    if routes is None or not isinstance(replay, RoutingReplay):
        trainer_logps, _ = policy.compute_logprobs(batch, compute_entropy=False)
        return contract_figures(out.logprobs, trainer_logps)
    # MoE with the engine's routing: the trainer's own routing first (measuring how often it differs), then
    # the engine's replayed (model.moe_routing_replay=r3)
    batch.routing = [torch.as_tensor(r) for r in routes]
    replay.apply = False
    try:
        trainer_logps, _ = policy.compute_logprobs(batch, compute_entropy=False)
        figures = contract_figures(out.logprobs, trainer_logps)
        figures["routing_mismatch"] = replay.last_metrics.get("moe/routing_mismatch_frac", 0.0)
    finally:
        replay.apply = True
    replayed, _ = policy.compute_logprobs(batch, compute_entropy=False)
    with_replay = contract_figures(out.logprobs, replayed)
    figures.update({f"replay_{k}": with_replay[k] for k in ("max_abs_diff", "mean_abs_diff", "k3_kl")})
    figures["replay_routing_mismatch"] = replay.last_metrics.get("moe/routing_mismatch_frac", 0.0)
    return figures


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
