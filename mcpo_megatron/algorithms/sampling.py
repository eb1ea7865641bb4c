"""DAPO's dynamic sampling filter (DAPO paper; verl ``filter_groups``; docs/algorithms.md §9).

Groups whose metric has zero spread (all correct or all wrong for the binary acc) give zero advantages; DAPO
drops them and samples more. MCPO keeps them (``filter_groups.enable=False``): mastered groups carry the
hinge-KL.
"""

from __future__ import annotations

import torch

from ._checks import as_1d, check_binary, check_group_layout


def dynamic_sampling_filter(metric, group_size: int, *, correct=None) -> tuple[torch.Tensor, dict[str, int]]:
    """Which groups to keep: those whose ``metric`` is not constant over the group.

    Args:
        metric: [num_groups * group_size] the filtered metric (verl's ``metric``: acc, score or shaped reward),
            group after group.
        group_size: responses per prompt.
        correct: the binary acc used to classify dropped groups as all-correct / all-wrong. Defaults to ``metric``
            when that is binary.

    Returns:
        ``(keep [num_groups] bool, counts)``; counts has ``groups``, ``kept``, ``dropped``, ``dropped_all_correct``,
        ``dropped_all_wrong`` and ``dropped_other`` (constant metric but mixed acc, e.g. a shaped score).
        Singleton groups are kept, as in verl (their advantage is 0 anyway).
    """
    m = as_1d("metric", metric).to(torch.float64)
    num_groups = check_group_layout("metric", m, group_size)
    if correct is None:
        is_binary = bool(((m == 0) | (m == 1)).all())
        c = m if is_binary else None
    else:
        c = check_binary("correct", as_1d("correct", correct))
        if c.shape != m.shape:
            raise ValueError(f"correct has shape {tuple(c.shape)} but metric has {tuple(m.shape)}; they must match.")
    mg = m.view(num_groups, group_size)
    constant = mg.amax(dim=1) == mg.amin(dim=1)
    keep = ~constant | (group_size == 1)
    dropped = ~keep
    if c is not None:
        cg = c.view(num_groups, group_size)
        all_correct = dropped & (cg.amin(dim=1) == 1)
        all_wrong = dropped & (cg.amax(dim=1) == 0)
    else:
        all_correct = torch.zeros_like(dropped)
        all_wrong = torch.zeros_like(dropped)
    counts = {
        "groups": num_groups,
        "kept": int(keep.sum()),
        "dropped": int(dropped.sum()),
        "dropped_all_correct": int(all_correct.sum()),
        "dropped_all_wrong": int(all_wrong.sum()),
        "dropped_other": int((dropped & ~all_correct & ~all_wrong).sum()),
    }
    return keep, counts


def kept_sequence_indices(keep_group_mask: torch.Tensor, group_size: int) -> torch.Tensor:
    """Long indices of the responses of the kept groups, in order (use with ``index_select`` or list indexing)."""
    keep = torch.as_tensor(keep_group_mask, dtype=torch.bool)
    if keep.dim() != 1:
        raise ValueError(f"keep_group_mask: expected [num_groups], got shape {tuple(keep.shape)}.")
    return keep.repeat_interleave(group_size).nonzero().flatten()
