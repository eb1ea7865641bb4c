"""Per-group mastery statistics, MCPO's query weight W(x) (Eq. 14) and the mastery tracker.

A group (the ``group_size`` responses to one prompt) is *mastered* when every response is correct and the group
has at least 2 responses (spec section 2); *majority-correct* when threshold < p < 1 (the groups that MCPO
reweights, Eq. 13); *all-wrong* when p = 0 (the groups GCPO injects a reference into). p always comes from the
verifier's binary acc, never from the shaped reward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ._checks import as_1d, check_binary, check_choice, check_group_layout
from .advantages import STD_MODES, mcpo_scale


@dataclass(frozen=True)
class GroupStats:
    """Statistics of ``num_groups`` groups; every tensor is [num_groups]."""

    group_size: int
    num_correct: torch.Tensor  # long
    p: torch.Tensor  # float64, fraction correct
    mastered: torch.Tensor  # bool: all correct and group_size >= 2
    majority_correct: torch.Tensor  # bool: threshold < p < 1
    all_wrong: torch.Tensor  # bool: p == 0

    def per_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """Repeat a per-group tensor once per response: [num_groups] -> [num_groups * group_size]."""
        return x.repeat_interleave(self.group_size)


def group_stats(correct, group_size: int, *, threshold: float = 0.5) -> GroupStats:
    """Group statistics from the verifier's binary acc laid out group after group.

    Empty responses are ordinary (incorrect or correct) entries and count in p (spec section 3).
    """
    c = check_binary("correct", as_1d("correct", correct))
    num_groups = check_group_layout("correct", c, group_size)
    cg = c.view(num_groups, group_size)
    num_correct = cg.sum(dim=1).round().long()
    p = num_correct.to(torch.float64) / group_size
    return GroupStats(
        group_size=group_size,
        num_correct=num_correct,
        p=p,
        mastered=(num_correct == group_size) & (group_size >= 2),
        majority_correct=(p > threshold) & (p < 1.0),
        all_wrong=num_correct == 0,
    )


def sequence_mastered(correct, group_size: int) -> torch.Tensor:
    """[num_groups * group_size] bool: the response belongs to a mastered group (hinge-KL applies to it)."""
    stats = group_stats(correct, group_size)
    return stats.per_sequence(stats.mastered)


def query_weight(
    p,
    group_size: int,
    *,
    estimator: str,
    std_mode: str = "unbiased",
    threshold: float = 0.5,
) -> torch.Tensor:
    """The query weight W(x) of Eq. (14): how strongly a prompt with success rate p drives the policy gradient.

    With binary rewards the group's gradient is W(x) * (mean grad log-prob of correct responses - mean of wrong
    ones); equivalently W(x) = (1/G) * sum of the advantages of the correct responses when the reward is the 0/1
    acc (eps -> 0). Closed forms:

    - ``grpo``: sqrt(p(1-p)) * f, with f = sqrt((G-1)/G) for the unbiased std (ddof=1) and 1 for population.
    - ``mcpo``: grpo's W divided by scale(p), i.e. f/2 for threshold < p < 1.
    - ``drgrpo``: p(1-p) (no std).

    W is 0 for p in {0, 1} (no signal) and for singleton groups.
    """
    check_choice("estimator", estimator, ("grpo", "drgrpo", "mcpo"))
    check_choice("std_mode", std_mode, STD_MODES)
    p = torch.as_tensor(p, dtype=torch.float64)
    if group_size < 2:
        return torch.zeros_like(p)
    q = (p * (1.0 - p)).clamp(min=0.0)
    if estimator == "drgrpo":
        return q
    f = math.sqrt((group_size - 1) / group_size) if std_mode == "unbiased" else 1.0
    w = torch.sqrt(q) * f
    if estimator == "mcpo":
        w = w / mcpo_scale(p, threshold=threshold)
    return w


class MasteryTracker:
    """Remembers, per prompt uid, the last observed p and mastered flag and the step they were seen at.

    Used for the retention metric: the accuracy, under the current policy, of the prompts that were mastered at
    the previous step. ``previously_mastered(uids)`` says which of the given prompts were mastered when last
    seen; ``retention(uids, p)`` averages the current p over those; ``mastered_at(step)`` lists the prompts
    mastered at a step (to re-evaluate them). ``state_dict``/``load_state_dict`` use plain Python types so the
    tracker goes into checkpoints.
    """

    def __init__(self) -> None:
        self._last: dict[str, tuple[float, bool, int]] = {}

    def __len__(self) -> int:
        return len(self._last)

    def update(self, uids, p, mastered, step: int) -> None:
        """Record the statistics of the prompts ``uids`` (one per group) observed at ``step``."""
        p = torch.as_tensor(p).tolist()
        mastered = torch.as_tensor(mastered).tolist()
        if not (len(uids) == len(p) == len(mastered)):
            raise ValueError(
                f"MasteryTracker.update: got {len(uids)} uids, {len(p)} p values and {len(mastered)} mastered "
                f"flags; pass one of each per group."
            )
        for uid, pi, mi in zip(uids, p, mastered):
            self._last[str(uid)] = (float(pi), bool(mi), int(step))

    def get(self, uid):
        """(p, mastered, step) last recorded for ``uid``, or None."""
        return self._last.get(str(uid))

    def previously_mastered(self, uids) -> torch.Tensor:
        """[len(uids)] bool: the prompt was mastered the last time it was recorded."""
        return torch.tensor([bool(self._last.get(str(u), (0.0, False, -1))[1]) for u in uids], dtype=torch.bool)

    def mastered_at(self, step: int) -> list[str]:
        """uids whose last record is from ``step`` and was mastered."""
        return [u for u, (_, m, s) in self._last.items() if m and s == step]

    def retention(self, uids, p) -> tuple[float, int]:
        """(mean current p over the previously mastered prompts among ``uids``, how many there were).

        Returns (nan, 0) when none of ``uids`` was previously mastered. Call it before ``update`` for the
        current step.
        """
        prev = self.previously_mastered(uids)
        p = torch.as_tensor(p, dtype=torch.float64)
        n = int(prev.sum())
        if n == 0:
            return float("nan"), 0
        return float(p[prev].mean()), n

    def state_dict(self) -> dict:
        return {"version": 1, "last": {u: list(v) for u, v in self._last.items()}}

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != 1:
            raise ValueError(f"MasteryTracker state version={state.get('version')!r}: expected 1.")
        self._last = {str(u): (float(v[0]), bool(v[1]), int(v[2])) for u, v in state["last"].items()}
