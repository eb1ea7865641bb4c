"""Replicate groups: runs that differ only by seed, summarised by a mean and an interval over seeds.

A report works on groups. Without a varying seed key every run is a group of one and the tables show its
values as before; with one, the runs that share every other varying key (``algorithm=mcpo``) form a group and
each table cell becomes ``mean ± half-width`` of the Student-t interval over the group's seeds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from mcpo_megatron.report.runs import Run, axis_value, short_names
from mcpo_megatron.report.stats import Interval, t_interval

Metric = Callable[[Run], Optional[float]]


@dataclass
class RunGroup:
    """Runs that are replicates of one experiment (the same config up to the seed keys)."""

    label: str
    runs: list[Run]

    @property
    def n(self) -> int:
        return len(self.runs)

    @property
    def seeds(self) -> list[Optional[str]]:
        return [r.seed for r in self.runs]

    def value(self, key: str) -> Any:
        """The group's value of a varying key other than ``seed`` (the same in every run of the group)."""
        return axis_value(self.runs[0], key)

    def values(self, metric: Metric) -> list[Optional[float]]:
        return [metric(r) for r in self.runs]

    def interval(self, metric: Metric, confidence: float = 0.95) -> Optional[Interval]:
        """Mean over the group's runs with the Student-t interval over seeds (runs without a value left out)."""
        return t_interval(self.values(metric), confidence)


def group_replicates(runs: Sequence[Run], axes: Sequence[str]) -> list[RunGroup]:
    """Runs grouped by their values of every varying key except ``seed``, in first-seen order, each group's runs
    ordered by seed. Without a ``seed`` axis every run is its own group, labelled like the run."""
    if "seed" not in axes:
        return [RunGroup(r.label, [r]) for r in runs]
    others = [k for k in axes if k != "seed"]
    short = short_names(others)
    groups: dict[str, list[Run]] = {}
    for r in runs:
        label = " ".join(f"{short[k]}={axis_value(r, k)}" for k in others) or "all runs"
        groups.setdefault(label, []).append(r)
    return [RunGroup(label, sorted(members, key=lambda r: _seed_order(r.seed))) for label, members in groups.items()]


def _seed_order(seed: Optional[str]) -> tuple:
    try:
        return (0, float(seed), "")
    except (TypeError, ValueError):
        return (1, 0.0, str(seed))


def is_replicated(groups: Sequence[RunGroup]) -> bool:
    return any(g.n > 1 for g in groups)
