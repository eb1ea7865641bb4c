"""GCPO reference injection (Group Contrastive Policy Optimization, arXiv 2510.07790; docs/algorithms.md §10).

When all G rollouts of a prompt are wrong, GRPO-style advantages are all zero and the prompt teaches nothing.
GCPO replaces one rollout with a verified golden answer (GA), so the group has one correct response: with
G = 16 and 0/1 rewards the GA gets A = 3.749985 and the others -0.249999 (unbiased std). Decisions [R]: the
lowest-reward rollout is replaced (the first one on ties); the GA must already be verified and, when an
``eos_token_id`` is given, end with it; it is skipped when missing or longer than ``max_len``. Old log-probs
of the GA come from the trainer's teacher-forced forward pass, so its ratio is 1 at the first update.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ._checks import as_1d, check_binary, check_group_layout


@dataclass
class Injection:
    """Result of ``inject_reference``; inputs are never modified."""

    rewards: torch.Tensor  # float64, with the reference's reward at the replaced positions
    correct: torch.Tensor  # float64 0/1, 1 at the replaced positions
    responses: list  # the responses with the references swapped in
    replaced: list[int] = field(default_factory=list)  # sequence index of each replaced rollout
    groups: list[int] = field(default_factory=list)  # the group of each replaced rollout
    counts: dict[str, int] = field(default_factory=dict)


def _length(x) -> int:
    return int(x.numel()) if isinstance(x, torch.Tensor) else len(x)


def _last(x):
    return int(x[-1].item()) if isinstance(x, torch.Tensor) else int(x[-1])


def inject_reference(
    rewards,
    correct,
    group_size: int,
    responses,
    references,
    *,
    max_len: int,
    reference_reward: float = 1.0,
    eos_token_id: int | None = None,
) -> Injection:
    """Swap a verified reference answer into every all-wrong group.

    Args:
        rewards: [num_groups * group_size] shaped rewards, group after group.
        correct: same shape, the verifier's binary acc.
        group_size: responses per prompt.
        responses: per-response token ids (lists or 1-D tensors), ``len == rewards.numel()``.
        references: per-group verified reference token ids, or None when the prompt has none.
        max_len: data.max_response_length; longer references are skipped.
        reference_reward: the reward the reference gets (the verifier's correct score plus its shaping).
        eos_token_id: when given, a reference must end with it.

    Returns:
        An ``Injection`` with the new rewards/correct/responses, the replaced sequence indices (so the trainer can
        swap token ids and recompute old log-probs) and counts: ``all_wrong_groups``, ``injected``,
        ``skipped_missing``, ``skipped_too_long``, ``skipped_no_eos``.
    """
    r = as_1d("rewards", rewards).to(torch.float64).clone()
    c = check_binary("correct", as_1d("correct", correct)).clone()
    if r.shape != c.shape:
        raise ValueError(f"rewards has shape {tuple(r.shape)} but correct has {tuple(c.shape)}; they must match.")
    num_groups = check_group_layout("rewards", r, group_size)
    if len(responses) != r.numel():
        raise ValueError(f"responses: {len(responses)} entries for {r.numel()} rewards; pass one per rollout.")
    if len(references) != num_groups:
        raise ValueError(
            f"references: {len(references)} entries for {num_groups} groups; pass one (or None) per group."
        )
    out = list(responses)
    counts = {"all_wrong_groups": 0, "injected": 0, "skipped_missing": 0, "skipped_too_long": 0, "skipped_no_eos": 0}
    replaced, groups = [], []
    all_wrong = c.view(num_groups, group_size).amax(dim=1) == 0
    for g in all_wrong.nonzero().flatten().tolist():
        counts["all_wrong_groups"] += 1
        ref = references[g]
        if ref is None or _length(ref) == 0:
            counts["skipped_missing"] += 1
            continue
        if _length(ref) > max_len:
            counts["skipped_too_long"] += 1
            continue
        if eos_token_id is not None and _last(ref) != eos_token_id:
            counts["skipped_no_eos"] += 1
            continue
        i = g * group_size + int(torch.argmin(r[g * group_size:(g + 1) * group_size]))
        r[i] = reference_reward
        c[i] = 1.0
        out[i] = ref
        replaced.append(i)
        groups.append(g)
        counts["injected"] += 1
    return Injection(rewards=r, correct=c, responses=out, replaced=replaced, groups=groups, counts=counts)
