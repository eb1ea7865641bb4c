"""Markdown tables of a report: throughput and time split per sweep axis, final evaluation (Table 1 layout)."""

from __future__ import annotations

import json
import math
from typing import Any, Optional, Sequence

from mcpo_megatron.report.runs import Run, axis_value

# Phases of a step, in loop order, as logged by the trainer's StepTimer (time/<phase>).
PHASES = ("rollout", "retention_probe", "reward", "old_logprobs", "train", "reshard", "eval", "checkpoint")


def phases_of(runs: Sequence[Run]) -> list[str]:
    """Timed phases present in any run: the known ones in loop order, then any other ``time/*`` key."""
    seen = {k[len("time/"):] for r in runs for k in r.summary.get("mean", {}) if k.startswith("time/")}
    seen.discard("step")
    return [p for p in PHASES if p in seen] + sorted(seen - set(PHASES))


def fmt(x: Optional[float], spec: str = ".3g") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "–"
    return format(x, spec)


def tokens_per_s_per_gpu(run: Run) -> tuple[Optional[float], str]:
    """Throughput per device: the accounting's ``perf/tokens_per_s_per_gpu`` (prompt + response tokens of the
    trained sequences) when logged, else the trainer's ``perf/generated_tokens_per_s`` / world size.
    Returns (value, source note)."""
    v = run.mean("perf/tokens_per_s_per_gpu")
    if v is not None:
        return v, ""
    total = run.mean("perf/generated_tokens_per_s")
    if total is not None:
        return total / (run.world_size or 1), "*"
    return None, ""


def scaling_efficiency(runs: Sequence[Run]) -> dict[int, Optional[float]]:
    """Per run (by id): tokens/s/GPU divided by that of the run with the fewest devices (ties: fewest nodes,
    then first given). 1.0 is perfect weak/strong scaling of per-device throughput."""
    def size(r: Run) -> tuple:
        return (r.world_size or 0, r.nodes or 0)

    base = min(runs, key=size)
    base_tp, _ = tokens_per_s_per_gpu(base)
    out: dict[int, Optional[float]] = {}
    for r in runs:
        tp, _ = tokens_per_s_per_gpu(r)
        out[id(r)] = tp / base_tp if tp is not None and base_tp else None
    return out


def group_by_others(runs: Sequence[Run], axis: str, axes: Sequence[str]) -> list[tuple[str, list[Run]]]:
    """Runs grouped by their values of every varying key except ``axis``; each group sorted along ``axis``."""
    groups: dict[str, list[Run]] = {}
    for r in runs:
        key = " ".join(f"{k.rsplit('.', 1)[-1]}={axis_value(r, k)}" for k in axes if k != axis)
        groups.setdefault(key, []).append(r)

    def order(r: Run):
        v = axis_value(r, axis)
        return (0, v, "") if isinstance(v, (int, float)) and not isinstance(v, bool) else (1, 0, json.dumps(v, default=str))

    return [(k, sorted(v, key=order)) for k, v in groups.items()]


def perf_table(runs: Sequence[Run], *, axis_name: Optional[str] = None) -> str:
    """One row per run: cluster shape, mean step time and its split, tokens/s/GPU, achieved TFLOP/s/GPU, MFU,
    scaling efficiency relative to the smallest run of the table, peak memory."""
    if axis_name == "nodes":  # already a column
        axis_name = None
    phases = phases_of(runs)
    eff = scaling_efficiency(runs)
    has_mfu = any(r.mean("perf/mfu") is not None for r in runs)
    head = ["run"] + ([axis_name] if axis_name else []) + ["nodes", "ranks", "step s"] + [f"{p} s" for p in phases] + [
        "tokens/s/GPU", "TFLOP/s/GPU"] + (["MFU"] if has_mfu else []) + ["scaling eff.", "peak mem GiB"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    note = False
    for r in runs:
        tp, src = tokens_per_s_per_gpu(r)
        note = note or bool(src)
        mfu = r.mean("perf/mfu")
        peak = r.summary.get("max", {}).get("memory/peak_gib")
        row = [r.label] + ([str(axis_value(r, axis_name))] if axis_name else []) + [
            fmt(r.nodes, "d") if r.nodes is not None else "–",
            fmt(r.world_size, "d") if r.world_size is not None else "–",
            fmt(r.mean("time/step"), ".2f")] + [fmt(r.mean(f"time/{p}"), ".2f") for p in phases] + [
            fmt(tp, ".1f") + src, fmt(r.mean("perf/achieved_tflops_per_s_per_gpu"), ".4g")] + (
            [fmt(100 * mfu, ".1f") + "%" if mfu is not None else "–"] if has_mfu else []) + [
            fmt(eff[id(r)], ".2f"), fmt(peak, ".2f")]
        lines.append("| " + " | ".join(row) + " |")
    text = "\n".join(lines) + "\n"
    if note:
        text += ("\n\\* no `perf/tokens_per_s_per_gpu` in this run's metrics: generated tokens/s "
                 "(`perf/tokens_per_s`) divided by the ranks.\n")
    return text


def learning_table(runs: Sequence[Run]) -> str:
    """Last logged value of the learning curves per run."""
    keys = [("acc/mean", "accuracy"), ("reward/mean", "reward"), ("mastery/mastered_frac", "mastered"),
            ("mastery/all_wrong_frac", "all-wrong"), ("retention/acc", "retention"), ("actor/entropy", "entropy"),
            ("response/length_mean", "resp. length")]
    keys = [(k, n) for k, n in keys if any(k in r.summary.get("final", {}) for r in runs)]
    head = ["run", "steps"] + [n for _, n in keys]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in runs:
        final = r.summary.get("final", {})
        lines.append("| " + " | ".join([r.label, str(r.summary["steps"])] + [fmt(final.get(k), ".3f")
                                                                              for k, _ in keys]) + " |")
    return "\n".join(lines) + "\n"


def eval_table(runs: Sequence[Run]) -> Optional[str]:
    """Final evaluation in the paper's Table 1 layout (rows: runs, columns: benchmarks, cells pass@1/pass@k);
    None when no run has evaluation results."""
    with_evals = [r for r in runs if r.evals]
    if not with_evals:
        return None
    from mcpo_megatron.evaluation import BenchmarkResult, markdown_table
    from mcpo_megatron.evaluation.report import DISPLAY_NAMES, format_score

    if all(isinstance(v, BenchmarkResult) for r in with_evals for v in r.evals.values()):
        return markdown_table({r.label: r.evals for r in with_evals})
    # Periodic evaluation logged in metrics.jsonl (eval/<benchmark>/pass@1, pass@k): the same layout from
    # the flat metrics.
    benches: list[str] = []
    for r in with_evals:
        benches += [b for b in r.evals if b not in benches]
    ks = sorted({m.split("@", 1)[1] for r in with_evals for v in r.evals.values() if isinstance(v, dict)
                 for m in v if m.startswith("pass@") and m != "pass@1"})
    k = ks[-1] if ks else None

    def cell(v: Any) -> str:
        if not isinstance(v, dict) or "pass@1" not in v:
            return "–"
        return format_score(v["pass@1"]) + (f"/{format_score(v[f'pass@{k}'])}" if k and f"pass@{k}" in v else "")

    head = "| | " + " | ".join(DISPLAY_NAMES.get(b, b) for b in benches) + " |"
    lines = [f"pass@1" + (f" / pass@{k}" if k else "") + " (unbiased estimator; last periodic evaluation)\n",
             head, "|---" * (len(benches) + 1) + "|"]
    for r in with_evals:
        lines.append(f"| {r.label} | " + " | ".join(cell(r.evals.get(b)) for b in benches) + " |")
    return "\n".join(lines) + "\n"
