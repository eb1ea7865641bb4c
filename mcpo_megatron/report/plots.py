"""PNG figures of a report (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from mcpo_megatron.report.runs import Run
from mcpo_megatron.report.tables import group_by_others, phases_of, tokens_per_s_per_gpu


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def curves(runs: Sequence[Run], panels: Sequence[tuple[str, str]], path: Path, *, title: str) -> Optional[Path]:
    """One panel per (metric key, y label), one line per run; None (no file) when no run logged any key."""
    panels = [(k, y) for k, y in panels if any(r.series(k)[0] for r in runs)]
    if not panels:
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6), squeeze=False)
    for ax, (key, ylabel) in zip(axes[0], panels):
        for r in runs:
            xs, ys = r.series(key)
            if xs:
                ax.plot(xs, ys, marker="o", markersize=3, label=r.label)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def throughput_vs_nodes(runs: Sequence[Run], axes: Sequence[str], path: Path) -> Optional[Path]:
    """tokens/s/GPU and total tokens/s against the number of nodes, a line per combination of the other
    varying keys; None when fewer than two node counts exist."""
    if len({r.nodes for r in runs if r.nodes is not None}) < 2:
        return None
    plt = _plt()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.6))
    for name, group in group_by_others([r for r in runs if r.nodes is not None], "nodes", axes):
        pts = [(r.nodes, tokens_per_s_per_gpu(r)[0], r.world_size or 1) for r in group]
        pts = [p for p in pts if p[1] is not None]
        if not pts:
            continue
        label = name or "runs"
        a1.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        a2.plot([p[0] for p in pts], [p[1] * p[2] for p in pts], marker="o", label=label)
    a1.set_ylabel("tokens/s per GPU (rank)")
    a2.set_ylabel("tokens/s (all ranks)")
    node_counts = sorted({r.nodes for r in runs if r.nodes is not None})
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


def time_split(runs: Sequence[Run], path: Path) -> Optional[Path]:
    """Stacked bars: mean seconds per phase of a step, one bar per run."""
    phases = phases_of(runs)
    if not phases:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(5, 1.4 * len(runs) + 2), 3.8))
    bottom = [0.0] * len(runs)
    x = list(range(len(runs)))
    for p in phases:
        vals = [r.mean(f"time/{p}") or 0.0 for r in runs]
        ax.bar(x, vals, bottom=bottom, label=p)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xticks(x)
    ax.set_xticklabels([r.label for r in runs], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("seconds per step (mean after warm-up)")
    ax.legend(fontsize=8)
    ax.set_title("Step time split")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
