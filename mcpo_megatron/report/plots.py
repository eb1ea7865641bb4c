"""PNG figures of a report (matplotlib, Agg backend: no display needed).

A group of seeds is drawn as its mean curve with a shaded band (the Student-t interval over the seeds at each
step, where at least two seeds logged the metric) and its seeds as thin lines; a group of one run as one line.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional, Sequence

from mcpo_megatron.report.groups import RunGroup
from mcpo_megatron.report.stats import t_interval
from mcpo_megatron.report.tables import group_by_others, phases_of, step_mean, tokens_per_s_per_gpu


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def band(group: RunGroup, key: str, confidence: float = 0.95):
    """(steps, means, lows, highs) of a metric over a group's seeds; lows/highs are None at steps where fewer
    than two seeds logged a finite value."""
    per_step: dict[int, list[float]] = {}
    for r in group.runs:
        for x, y in zip(*r.series(key)):
            per_step.setdefault(x, []).append(y)
    steps, means, lows, highs = [], [], [], []
    for x in sorted(per_step):
        iv = t_interval(per_step[x], confidence)
        steps.append(x)
        means.append(iv.mean)
        lows.append(iv.low)
        highs.append(iv.high)
    return steps, means, lows, highs


def curves(groups: Sequence[RunGroup], panels: Sequence[tuple[str, str]], path: Path, *, title: str,
           confidence: float = 0.95) -> Optional[Path]:
    """One panel per (metric key, y label), one line (or mean and band) per group; None (no file) when no run
    logged any key.  With few seeds a t-interval can be far wider than the metric's range (t = 12.7 at n = 2),
    so a panel's y-axis spans the runs' own values and wider bands are cut at its edges."""
    panels = [(k, y) for k, y in panels if any(r.series(k)[0] for g in groups for r in g.runs)]
    if not panels:
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6), squeeze=False)
    replicated = any(g.n > 1 for g in groups)
    for ax, (key, ylabel) in zip(axes[0], panels):
        seen: list[float] = []
        for i, g in enumerate(groups):
            color = f"C{i % 10}"
            if g.n == 1:
                xs, ys = g.runs[0].series(key)
                if xs:
                    ax.plot(xs, ys, marker="o", markersize=3, label=g.label, color=color)
                continue
            for r in g.runs:
                xs, ys = r.series(key)
                ax.plot(xs, ys, color=color, alpha=0.25, linewidth=0.8)
                seen += [y for y in ys if math.isfinite(y)]
            steps, means, lows, highs = band(g, key, confidence)
            if not steps:
                continue
            ax.plot(steps, means, marker="o", markersize=3, color=color, label=f"{g.label} (n={g.n})")
            pts = [(x, lo, hi) for x, lo, hi in zip(steps, lows, highs) if lo is not None]
            if pts:
                ax.fill_between([p[0] for p in pts], [p[1] for p in pts], [p[2] for p in pts], color=color,
                                alpha=0.2, linewidth=0)
        if seen:
            pad = 0.08 * (max(seen) - min(seen)) or 0.05 * max(1.0, abs(max(seen)))
            ax.set_ylim(min(seen) - pad, max(seen) + pad)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    if replicated:
        title += f" (mean over seeds, band: {100 * confidence:g}% t-interval; thin lines: seeds)"
    fig.suptitle(title, fontsize=10 if replicated else 12)
    fig.tight_layout()
    # the legend under the panels, where run labels of any length cover no curve
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.0), fontsize=8,
               ncol=1 if max(map(len, labels), default=0) > 50 else min(3, len(labels) or 1))
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def throughput_vs_nodes(groups: Sequence[RunGroup], axes: Sequence[str], path: Path,
                        confidence: float = 0.95) -> Optional[Path]:
    """tokens/s/GPU and total tokens/s against the number of nodes, a line per combination of the other
    varying keys (error bars: the interval over seeds); None when fewer than two node counts exist."""
    with_nodes = [g for g in groups if g.runs[0].nodes is not None]
    if len({g.runs[0].nodes for g in with_nodes}) < 2:
        return None
    plt = _plt()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.6))
    for name, line in group_by_others(with_nodes, "nodes", axes):
        pts = []
        for g in line:
            ws = g.runs[0].world_size or 1
            per_gpu = g.interval(lambda r: tokens_per_s_per_gpu(r)[0], confidence)
            if per_gpu is not None:
                pts.append((g.runs[0].nodes, per_gpu, ws))
        if not pts:
            continue
        label = name or "runs"
        xs = [p[0] for p in pts]
        err = [p[1].half_width or 0.0 for p in pts]
        a1.errorbar(xs, [p[1].mean for p in pts], yerr=err, marker="o", capsize=3, label=label)
        a2.errorbar(xs, [p[1].mean * p[2] for p in pts], yerr=[e * p[2] for e, p in zip(err, pts)], marker="o",
                    capsize=3, label=label)
    a1.set_ylabel("tokens/s per GPU (rank)")
    a2.set_ylabel("tokens/s (all ranks)")
    node_counts = sorted({g.runs[0].nodes for g in with_nodes})
    for a in (a1, a2):
        a.set_xticks(node_counts)
        a.set_xlabel("nodes")
        a.grid(alpha=0.3)
    a1.legend(fontsize=8)
    fig.suptitle("Throughput vs nodes")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def time_split(groups: Sequence[RunGroup], path: Path, confidence: float = 0.95) -> Optional[Path]:
    """Stacked bars: mean seconds per phase of a step, one bar per group (error bar: the interval over seeds of
    the mean step time)."""
    phases = phases_of([r for g in groups for r in g.runs])
    if not phases:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(5, 1.4 * len(groups) + 2), 3.8))
    bottom = [0.0] * len(groups)
    x = list(range(len(groups)))
    for p in phases:
        vals = []
        for g in groups:
            iv = g.interval(step_mean(f"time/{p}"), confidence)
            vals.append(iv.mean if iv else 0.0)
        ax.bar(x, vals, bottom=bottom, label=p)
        bottom = [b + v for b, v in zip(bottom, vals)]
    steps = [g.interval(step_mean("time/step"), confidence) for g in groups]
    if any(iv is not None and iv.half_width is not None for iv in steps):
        ax.errorbar(x, [iv.mean if iv else 0.0 for iv in steps],
                    yerr=[(iv.half_width or 0.0) if iv else 0.0 for iv in steps], fmt="none", ecolor="black",
                    capsize=4, label=f"step time, {100 * confidence:g}% interval")
    ax.set_xticks(x)
    ax.set_xticklabels([g.label for g in groups], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("seconds per step (mean after warm-up)")
    ax.legend(fontsize=8)
    ax.set_title("Step time split")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
