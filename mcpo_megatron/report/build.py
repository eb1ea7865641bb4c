"""Run directories -> ``report.md`` with tables and PNG figures."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from mcpo_megatron.report import plots
from mcpo_megatron.report.runs import Run, assign_labels, axis_value, load_run, varying_keys
from mcpo_megatron.report.tables import eval_table, group_by_others, learning_table, perf_table

FIGURES = {
    "reward_acc.png": "Accuracy and reward vs step",
    "mastery.png": "Mastered and all-wrong group fractions (the paper's Fig. 5)",
    "retention.png": "Retention of previously mastered prompts (the paper's Fig. 7)",
    "entropy.png": "Policy entropy",
    "throughput_vs_nodes.png": "Throughput vs nodes",
    "time_split.png": "Step time split",
}


def load_runs(run_dirs: Sequence[str | Path], *, warmup_steps: int = 1) -> list[Run]:
    runs = [load_run(d, warmup_steps=warmup_steps) for d in run_dirs]
    if not runs:
        raise ValueError("no run directories given")
    assign_labels(runs, varying_keys(runs))
    return runs


def build_report(run_dirs: Sequence[str | Path], out_dir: str | Path, *, warmup_steps: int = 1,
                 title: str = "Run report", note: Optional[str] = None) -> Path:
    """Write ``<out_dir>/report.md`` and its PNG figures; returns the report's path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    runs = load_runs(run_dirs, warmup_steps=warmup_steps)
    axes = varying_keys(runs)

    md = [f"# {title}\n"]
    if note:
        md.append(note.strip() + "\n")
    md.append(f"{len(runs)} run(s). Step statistics are means over the steps after the first {warmup_steps} "
              "(warm-up); memory is the peak over all steps. Runs are labelled by the config keys that differ "
              f"between them: {', '.join(f'`{a}`' for a in axes) or 'none (labelled by directory)'}.\n")
    md.append("| run | directory | steps |\n|---|---|---|\n" + "".join(
        f"| {r.label} | `{r.path}` | {r.summary['steps']} |\n" for r in runs))

    md.append("## Throughput and step time\n")
    if not axes:
        md.append(perf_table(runs))
    for axis in axes:
        md.append(f"### Sweep axis `{axis}`\n")
        md.append("Scaling efficiency: tokens/s/GPU relative to the run with the fewest ranks in the same table "
                  "(the other varying keys fixed).\n")
        for name, group in group_by_others(runs, axis, axes):
            if name:
                md.append(f"**{name}**\n")
            md.append(perf_table(group, axis_name=axis))

    md.append("## Learning (last step)\n")
    md.append(learning_table(runs))
    evals = eval_table(runs)
    if evals:
        md.append("## Final evaluation\n")
        md.append(evals)

    made = {
        "reward_acc.png": plots.curves(runs, [("acc/mean", "accuracy"), ("reward/mean", "reward")],
                                       out / "reward_acc.png", title="Accuracy and reward"),
        "mastery.png": plots.curves(runs, [("mastery/mastered_frac", "mastered fraction"),
                                           ("mastery/all_wrong_frac", "all-wrong fraction")],
                                    out / "mastery.png", title="Mastered and all-wrong groups"),
        "retention.png": plots.curves(runs, [("retention/acc", "accuracy on previously mastered prompts"),
                                             ("retention/probe_acc", "retention probe accuracy")],
                                      out / "retention.png", title="Retention of mastered prompts"),
        "entropy.png": plots.curves(runs, [("actor/entropy", "entropy (nats/token)")], out / "entropy.png",
                                    title="Policy entropy"),
        "throughput_vs_nodes.png": plots.throughput_vs_nodes(runs, axes, out / "throughput_vs_nodes.png"),
        "time_split.png": plots.time_split(runs, out / "time_split.png"),
    }
    md.append("## Figures\n")
    for name, caption in FIGURES.items():
        if made[name] is not None:
            md.append(f"### {caption}\n\n![{caption}]({name})\n")
    missing = [FIGURES[n] for n, p in made.items() if p is None]
    if missing:
        md.append("Not drawn (no data in these runs): " + "; ".join(missing) + ".\n")

    path = out / "report.md"
    path.write_text("\n".join(md))
    return path


__all__ = ["build_report", "load_runs", "FIGURES", "axis_value"]
