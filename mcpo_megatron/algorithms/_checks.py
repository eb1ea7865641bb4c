"""Input checks shared by the algorithm modules: each error names the argument, its value, the rule and a fix."""

from __future__ import annotations

import torch


def as_1d(name: str, x, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Return ``x`` as a 1-D tensor or raise a ValueError that says what was expected."""
    t = x if isinstance(x, torch.Tensor) else torch.as_tensor(x)
    if t.dim() != 1:
        raise ValueError(
            f"{name}: expected a 1-D tensor laid out group after group, got shape {tuple(t.shape)}; "
            f"flatten it as [num_groups * group_size]."
        )
    return t if dtype is None else t.to(dtype)


def check_group_layout(name: str, x: torch.Tensor, group_size: int) -> int:
    """Check that ``x`` holds whole groups of ``group_size`` and return the number of groups."""
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1:
        raise ValueError(f"group_size={group_size!r}: must be an integer >= 1 (rollout.n responses per prompt).")
    if x.numel() % group_size != 0:
        raise ValueError(
            f"{name}: length {x.numel()} is not a multiple of group_size={group_size}; "
            f"pass whole groups (rollout.n responses per prompt, group after group)."
        )
    return x.numel() // group_size


def check_binary(name: str, x: torch.Tensor) -> torch.Tensor:
    """Check that ``x`` holds only 0/1 (or bools) and return it as float64."""
    xf = x.to(torch.float64)
    bad = ~((xf == 0) | (xf == 1))
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"{name}[{i}]={xf[i].item()!r}: must be the verifier's binary acc (0 or 1), never a shaped score; "
            f"pass the reward result's acc field."
        )
    return xf


def check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r}: must be one of {list(choices)}.")


def as_bool(x, name: str) -> torch.Tensor:
    """``x`` as a bool tensor (nonzero is True); a ValueError naming ``name`` when it is not a tensor."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}: expected a tensor, got {type(x).__name__}.")
    return x if x.dtype == torch.bool else x != 0
