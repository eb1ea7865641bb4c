"""``mcpo plan``'s text: the memory tables, the preemption lead and the engine / training split, markdown-compatible
(docs/scaling.md shows them; tests/test_docs.py keeps the docs' blocks equal to the output)."""

from __future__ import annotations

from typing import Any

from mcpo_megatron.planner.common import GIB
from mcpo_megatron.planner.phases import Plan


def format_plan(p: Plan, title: str = "") -> str:
    """The plan as a text table (term, GiB, note) per phase, markdown-compatible; with trainer.offload also the
    rollout phase without it, the engine's capacity both ways and what the offload costs."""
    lines = []
    if title:
        lines.append(title)
    if p.separate:
        phases = ((f"training ranks ({p.train_world_size})", p.training),
                  (f"engine ranks ({p.rollout_world_size})", p.rollout))
    else:
        phases = (("training phase", p.training), ("rollout phase", p.rollout))
        if p.rollout_without_offload is not None:
            phases += (("rollout phase without offload", p.rollout_without_offload),)
    for phase, terms in phases:
        lines.extend(_table(phase, terms, p.gpu_mem_bytes))
    lines.append("")
    e = p.engine
    if p.engine_without_offload is None:
        lines.append(f"engine (rollout TP={e['rollout_tp']}): {_capacity(e)}")
    else:
        lines.append(f"engine (rollout TP={e['rollout_tp']}), with offload: {_capacity(e)}")
        lines.append(f"engine (rollout TP={e['rollout_tp']}), without offload: {_capacity(p.engine_without_offload)}")
    if p.offload is not None:
        lines.extend(_offload_lines(p.offload))
    if p.separate:
        lines.append(f"host: each training rank stages its shards of the newest weights for the engines, at most "
                     f"{p.host_weights_bytes / GIB:.1f} GiB (bf16), page-locked")
    return "\n".join(lines)


def _table(phase: str, terms, gpu_mem_bytes: float) -> list[str]:
    lines = ["", f"| {phase:<14} | {'GiB':>7} | note |", f"|{'-' * 16}|{'-' * 8}:|------|"]
    for t in terms:
        lines.append(f"| {t.name:<14} | {t.gib:7.2f} | {t.note} |")
    total = Plan.total(terms)
    lines.append(f"| {'total':<14} | {total / GIB:7.2f} | of {gpu_mem_bytes / GIB:g} GiB "
                 f"({100 * total / gpu_mem_bytes:.0f}%) |")
    return lines


def _capacity(e: dict[str, float]) -> str:
    state = e.get("state_bytes_per_sequence", 0.0)
    per_sequence = f" + {state / 2**20:.0f} MiB recurrent state/sequence" if state else ""
    return (f"KV cache {max(0.0, e['kv_cache']) / GIB:.1f} GiB = {e['kv_tokens'] / 1e3:.0f}k tokens "
            f"({e['kv_bytes_per_token'] / 1024:.0f} KiB/token{per_sequence}) = {e['full_length_sequences']:.1f} "
            "sequences of "
            f"{e['max_sequence_length']} tokens per replica")


def _offload_lines(o: dict[str, Any]) -> list[str]:
    moved = ", ".join(f"{k} {v / GIB:.1f}" for k, v in o["moved"].items() if k != "grads" and v > 0)
    return [
        f"offload (trainer.offload): per GPU {o['copied_bytes'] / GIB:.1f} GiB copied to pinned host memory "
        f"({moved}) and {o['released_bytes'] / GIB:.1f} GiB of gradients released without a copy",
        f"  host memory per node: {o['gpus_per_node']} x {o['copied_bytes'] / GIB:.1f} = "
        f"{o['host_per_node_bytes'] / GIB:.0f} GiB pinned of {o['host_mem_bytes'] / GIB:g} GiB (--host-mem-gb)",
        f"  moving it at {o['gbps']:g} GB/s per GPU (--offload-gbps): {o['seconds']:.1f} s to host after each "
        f"weight update, {o['seconds']:.1f} s back before each step's training",
    ]


def format_preempt_lead(lead: dict[str, float], world: int, peak_flops: float, mfu: float,
                        fs_write_gbps: float) -> str:
    return "\n".join([
        "",
        "preemption lead (a signal just after generation, every response at its maximum length):",
        f"  old log-probs + updates: {lead['train_flops']:.3g} FLOP / ({world} GPUs x {peak_flops / 1e12:.0f} "
        f"TFLOP/s x MFU {mfu:g}) = {lead['train_s']:.0f} s",
        *([f"  the next step's batch, generated meanwhile (the checkpoint waits for it): {lead['generate_flops']:.3g} "
           f"FLOP / ({lead['engine_world']} engine GPUs x {peak_flops / 1e12:.0f} TFLOP/s x MFU "
           f"{lead['generate_mfu']:g}) = {lead['generate_s']:.0f} s; the longer of the two counts"]
          if "generate_s" in lead else []),
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
