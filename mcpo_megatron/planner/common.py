"""What every part of the planner shares: the unit and how a config value is read."""

from __future__ import annotations

from typing import Any

GIB = 1024 ** 3


def cfg_get(cfg: Any, dotted: str, default: Any = None) -> Any:
    """``cfg``'s value at ``dotted`` ("rollout.n"), ``default`` when absent or None (a config object or nested
    mappings)."""
    node = cfg
    for part in dotted.split("."):
        if node is None:
            return default
        node = node.get(part, None) if hasattr(node, "get") else getattr(node, part, None)
    return default if node is None else node
