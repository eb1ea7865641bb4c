"""Run directories -> ``report.md`` with tables and PNG figures.

Runs that differ only by seed (``runs.SEED_KEYS``) are grouped; each table then shows a group's mean ± the
half-width of the Student-t interval over its seeds, the figures draw bands, and a differences table compares
every group with a reference group (Welch intervals).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from mcpo_megatron.report import plots
from mcpo_megatron.report.groups import RunGroup, group_replicates, is_replicated
from mcpo_megatron.report.runs import (Run, assign_labels, assign_seeds, axis_value, load_run, seed_keys,
                                       varying_keys)
from mcpo_megatron.report.tables import (differences_table, eval_problem_intervals, eval_table, group_by_others,
                                         interval_note, learning_table, perf_table, retention_table, row)

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
    assign_seeds(runs)
    assign_labels(runs, varying_keys(runs))
    return runs


def find_group(groups: Sequence[RunGroup], name: str) -> RunGroup:
    """The group whose label is ``name``, or the only one whose label contains it (``dapo`` matches
    ``algorithm=dapo (filter_groups.enable=False)``)."""
    exact = [g for g in groups if g.label == name]
    if exact:
        return exact[0]
    partial = [g for g in groups if name in g.label]
    if len(partial) == 1:
        return partial[0]
    labels = ", ".join(repr(g.label) for g in groups)
    what = "matches several groups" if partial else "matches no group"
    raise ValueError(f"--reference {name!r} {what}; give a group label (or a unique part of one): {labels}")


def build_report(run_dirs: Sequence[str | Path], out_dir: str | Path, *, warmup_steps: int = 1,
                 title: str = "Run report", note: Optional[str] = None, last_steps: int = 1,
                 confidence: float = 0.95, reference: Optional[str] = None) -> Path:
    """Write ``<out_dir>/report.md`` and its PNG figures; returns the report's path.

    ``last_steps``: the learning table averages each run's last ``last_steps`` logged values (1: the last one).
    ``confidence``: of every interval. ``reference``: the group the differences table compares against
    (default: the first group).
    """
    if last_steps < 1:
        raise ValueError(f"last_steps={last_steps}: must be >= 1")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence={confidence}: must be strictly between 0 and 1, e.g. 0.95")
    out = Path(out_dir)
    runs = load_runs(run_dirs, warmup_steps=warmup_steps)
    axes = varying_keys(runs)
    groups = group_replicates(runs, axes)
    replicated = is_replicated(groups)
    ref = find_group(groups, reference) if reference is not None else groups[0]
    out.mkdir(parents=True, exist_ok=True)
    table_axes = [a for a in axes if a != "seed"]

    md = [f"# {title}\n"]
    if note:
        md.append(note.strip() + "\n")
    md.append(f"{len(runs)} run(s). Step statistics are means over the steps after the first {warmup_steps} "
              "(warm-up); memory is the peak over all steps. Runs are labelled by the config keys that differ "
              f"between them: {', '.join(f'`{a}`' for a in axes) or 'none (labelled by directory)'}.\n")
    if replicated:
        md.append(f"Runs that differ only in a seed key ({', '.join(f'`{k}`' for k in seed_keys(runs))}) are "
                  f"grouped as replicates: {len(groups)} group(s). " + interval_note(groups, confidence))
    md.append("| run | directory | steps |\n|---|---|---|\n" + "".join(
        row([r.label, f"`{r.path}`", r.summary["steps"]]) + "\n" for r in runs))
    if replicated:
        md.append("| group | seeds | runs |\n|---|---|---|\n" + "".join(
            row([g.label, ", ".join(str(s) for s in g.seeds), g.n]) + "\n" for g in groups))

    md.append("## Throughput and step time\n")
    if not table_axes:
        md.append(perf_table(groups, confidence=confidence))
    for axis in table_axes:
        md.append(f"### Sweep axis `{axis}`\n")
        md.append("Scaling efficiency: tokens/s/GPU relative to the run with the fewest ranks in the same table "
                  "(the other varying keys fixed).\n")
        for name, part in group_by_others(groups, axis, table_axes):
            if name:
                md.append(f"**{name}**\n")
            md.append(perf_table(part, axis_name=axis, confidence=confidence))

    window = "last step" if last_steps == 1 else f"mean of the last {last_steps} logged values of each curve"
    md.append(f"## Learning ({window})\n")
    md.append(learning_table(groups, last_steps=last_steps, confidence=confidence))
    retention = retention_table(groups, confidence=confidence)
    if retention:
        md.append("## Mastery and retention (whole run)\n")
        md.append("Means over every logged step. Retention is the accuracy, under the current policy, of prompts "
                  "that were mastered (all rollouts correct) when last seen: on the mastered prompts that recur in "
                  "a training batch (weighted by their number), and on the retention probe's extra rollouts of the "
                  "previous step's mastered prompts (pooled). Hinge active: the share of mastered tokens whose "
                  "log-ratio was past the hinge-KL's margin, over the steps that had mastered tokens (weighted by "
                  "their share); PPO KL: the mean of old_logp - logp over each step's updates.\n")
        md.append(retention)
    evals = eval_table(groups, confidence=confidence)
    if evals:
        md.append("## Final evaluation\n")
        md.append(evals)
        problems = eval_problem_intervals(groups, confidence=confidence)
        if problems:
            md.append(f"Per run: {100 * confidence:g}% percentile-bootstrap intervals over the benchmark's problems "
                      "(problems resampled with replacement, 2000 draws, seed 0), for pass@1 and the unbiased "
                      "pass@k.\n")
            md.append(problems)
    if replicated and len(groups) > 1:
        md.append(f"## Differences from `{ref.label}`\n")
        md.append(f"Difference of group means with Welch's {100 * confidence:g}% t-interval over seeds (unequal "
                  "variances, Welch-Satterthwaite degrees of freedom): the seed-to-seed uncertainty. Rows marked "
                  "'bootstrap over problems' give the other source for a benchmark: per problem, the difference "
                  "of the seed-averaged scores, with a paired percentile bootstrap over the problems (2000 draws, "
                  "seed 0). **Bold**: the interval excludes 0.\n")
        md.append(differences_table(groups, ref, last_steps=last_steps, confidence=confidence))

    made = {
        "reward_acc.png": plots.curves(groups, [("acc/mean", "accuracy"), ("reward/mean", "reward")],
                                       out / "reward_acc.png", title="Accuracy and reward", confidence=confidence),
        "mastery.png": plots.curves(groups, [("mastery/mastered_frac", "mastered fraction"),
                                             ("mastery/all_wrong_frac", "all-wrong fraction")],
                                    out / "mastery.png", title="Mastered and all-wrong groups", confidence=confidence),
        "retention.png": plots.curves(groups, [("retention/acc", "accuracy on previously mastered prompts"),
                                               ("retention/probe_acc", "retention probe accuracy")],
                                      out / "retention.png", title="Retention of mastered prompts",
                                      confidence=confidence),
        "entropy.png": plots.curves(groups, [("actor/entropy", "entropy (nats/token)")], out / "entropy.png",
                                    title="Policy entropy", confidence=confidence),
        "throughput_vs_nodes.png": plots.throughput_vs_nodes(groups, table_axes, out / "throughput_vs_nodes.png",
                                                             confidence=confidence),
        "time_split.png": plots.time_split(groups, out / "time_split.png", confidence=confidence),
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


__all__ = ["build_report", "load_runs", "find_group", "FIGURES", "axis_value"]
