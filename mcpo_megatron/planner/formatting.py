"""``mcpo plan``'s text: the memory tables, the preemption lead and the engine / training split, markdown-compatible
(docs/scaling.md shows them; tests/test_docs.py keeps the docs' blocks equal to the output)."""

from __future__ import annotations

from typing import Any

from mcpo_megatron.planner.common import GIB
from mcpo_megatron.planner.phases import Plan


def format_plan(p: Plan, title: str = "") -> str:
    """The plan as a text table (term, GiB, note) per phase, markdown-compatible."""
    lines = []
    if title:
        lines.append(title)
    phases = ((f"training ranks ({p.train_world_size})", p.training), (f"engine ranks ({p.rollout_world_size})",
              p.rollout)) if p.separate else (("training phase", p.training), ("rollout phase", p.rollout))
    for phase, terms in phases:
        lines.append("")
        lines.append(f"| {phase:<14} | {'GiB':>7} | note |")
        lines.append(f"|{'-' * 16}|{'-' * 8}:|------|")
        for t in terms:
            lines.append(f"| {t.name:<14} | {t.gib:7.2f} | {t.note} |")
        total = Plan.total(terms)
        lines.append(f"| {'total':<14} | {total / GIB:7.2f} | of {p.gpu_mem_bytes / GIB:g} GiB "
                     f"({100 * total / p.gpu_mem_bytes:.0f}%) |")
    e = p.engine
    lines.append("")
    lines.append(f"engine (rollout TP={e['rollout_tp']}): KV cache {max(0.0, e['kv_cache']) / GIB:.1f} GiB = "
                 f"{e['kv_tokens'] / 1e3:.0f}k tokens ({e['kv_bytes_per_token'] / 1024:.0f} KiB/token) = "
                 f"{e['full_length_sequences']:.1f} sequences of {e['max_sequence_length']} tokens per replica")
    if p.separate:
        lines.append(f"host: the trainer's first rank keeps the newest weights for the engines, "
                     f"{p.host_weights_bytes / GIB:.1f} GiB (bf16), pinned")
    return "\n".join(lines)


def format_preempt_lead(lead: dict[str, float], world: int, peak_flops: float, mfu: float,
                        fs_write_gbps: float) -> str:
    return "\n".join([
        "",
        "preemption lead (a signal just after generation, every response at its maximum length):",
        f"  old log-probs + updates: {lead['train_flops']:.3g} FLOP / ({world} GPUs x {peak_flops / 1e12:.0f} "
        f"TFLOP/s x MFU {mfu:g}) = {lead['train_s']:.0f} s",
        f"  checkpoint: {lead['checkpoint_bytes'] / 1e9:.0f} GB at {fs_write_gbps:g} GB/s = {lead['checkpoint_s']:.0f} s",
        f"  submit with SBATCH_SIGNAL=B:USR1@{int(lead['suggested_lead_s'])} (slurm/train.sbatch); the trainer logs "
        "the measured figure as time/preempt_lead_needed",
    ])


def format_split(rows: list[dict[str, Any]], world: int, source: str, limit: int = 6) -> str:
    if not rows:
        return (f"\nno division of the {world} ranks into engine and training ranks passes the config's rules "
                "(rollout TP, TP x PP, mini-batch per DP rank)")
    lines = ["", f"engine / training ranks ({source}; step with generation overlapping training, "
                 "trainer.max_staleness >= 1, and without):",
             "| engine ranks | nodes | generation s | training s | overlapped s | sequential s |",
             "|---:|---:|---:|---:|---:|---:|"]
    for r in rows[:limit]:
        lines.append(f"| {r['ranks']} | {r['nodes'] if r['nodes'] is not None else '-'} | {r['generate_s']:.0f} | "
                     f"{r['train_s']:.0f} | {r['overlapped_s']:.0f} | {r['sequential_s']:.0f} |")
    best = rows[0]
    whole = [r for r in rows if r["nodes"] is not None]
    lines.append(f"suggested: rollout.ranks={best['ranks']}" + (
        f"; in whole nodes: ROLLOUT_NODES={whole[0]['nodes']} (rollout.ranks={whole[0]['ranks']}, "
        f"{whole[0]['overlapped_s']:.0f} s)" if whole else ""))
    return "\n".join(lines)
