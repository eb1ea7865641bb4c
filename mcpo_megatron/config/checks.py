"""What a section's ``check`` works with: the collector of violations, and field declarations that carry their
own rule (allowed values, lower bounds), so that the schema reads as fields next to their rules."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Optional


_FIRST = object()


def choice(*allowed: Any, default: Any = _FIRST) -> Any:
    """A field that must take one of ``allowed``; its default is the first of them unless given."""
    return field(default=allowed[0] if default is _FIRST else default, metadata={"choices": allowed})


def at_least(default: Any, minimum: int) -> Any:
    """An integer field that must be ``>= minimum`` (1 for sizes and counts, 0 for intervals)."""
    return field(default=default, metadata={"min": minimum})


@dataclass
class Checks:
    """Collects violations (``<key>=<value>: <rule>; <fix>``) and warnings while sections check themselves.

    ``cfg`` is the whole :class:`~mcpo_megatron.config.schema.Config` (cross-section rules read other
    sections through it), ``shape`` the model's :class:`~mcpo_megatron.config.shapes.ModelShape` when
    known, ``derived`` the sizes that follow from the world size, ``cuda`` whether this machine has a GPU and
    ``vllm`` whether vLLM is installed (both None unless the device rules were asked for). ``world_size`` is
    the ranks that train (the launch's ``launch_world_size`` less ``rollout.ranks`` with separate placement).
    """

    cfg: Any
    world_size: int
    launch_world_size: int = 0
    shape: Any = None
    derived: Any = None
    cuda: Optional[bool] = None
    vllm: Optional[bool] = None
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def error(self, key: str, value: Any, rule: str, fix: str) -> None:
        self.errors.append(f"{key}={value}: {rule}; {fix}")

    def warn(self, message: str) -> None:
        self.warnings.append(message)

    def fields_of(self, section: Any, prefix: str) -> None:
        """The per-field rules of ``section`` (declared with :func:`choice` / :func:`at_least`), recursively, and
        one rule for every float: it is finite (inf and nan pass most bounds, e.g. ``> 0``, and then break the
        run once its model is built: a deadline of inf seconds, a temperature of inf)."""
        for f in fields(section):
            key, value = f"{prefix}.{f.name}", getattr(section, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                self.error(key, value, "must be a finite number", f"set {key} to a finite value")
            if "choices" in f.metadata and value not in f.metadata["choices"]:
                self.error(key, value, "must be one of " + " | ".join(str(x) for x in f.metadata["choices"]),
                           f"set {key} to one of those")
            if "min" in f.metadata and value < f.metadata["min"]:
                if f.metadata["min"] == 1:
                    self.error(key, value, "must be >= 1", "set a positive value")
                else:
                    self.error(key, value, f"must be >= {f.metadata['min']}", "set 0 or a positive value")
            if is_dataclass(value):
                self.section(value, key)

    def section(self, section: Any, prefix: str) -> None:
        """Field rules, then the section's own ``check`` (cross-field and cross-section rules)."""
        self.fields_of(section, prefix)
        own = getattr(section, "check", None)
        if own is not None:
            own(self)
