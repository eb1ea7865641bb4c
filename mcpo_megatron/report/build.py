"""Run directories -> ``report.md`` with tables and PNG figures.

Runs that differ only by seed (``runs.SEED_KEYS``) are grouped; each table then shows a group's mean ± the
half-width of the Student-t interval over its seeds, the figures draw bands, and a differences table compares
every group with a reference group (Welch intervals).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from mcpo_megatron.report import plots
from mcpo_megatron.report.groups import RunGroup, group_replicates, is_replicated
from mcpo_megatron.report.runs import (Run, assign_labels, assign_seeds, axis_value, load_run, seed_keys,
                                       varying_keys)
from mcpo_megatron.report.differences import differences_table
from mcpo_megatron.report.tables import (eval_problem_intervals, eval_table, group_by_others, interval_note,
                                         learning_table, perf_table, retention_table, row)

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


@dataclass(frozen=True)
class ReportOptions:
    """What a report shows besides its runs.

    ``warmup_steps``: steps left out of each run's step statistics. ``last_steps``: the learning table averages
    each run's last ``last_steps`` logged values (1: the last one). ``confidence``: of every interval.
    ``reference``: the group the differences table compares against (default: the first group).
    """

    title: str = "Run report"
    note: Optional[str] = None
    warmup_steps: int = 1
    last_steps: int = 1
    confidence: float = 0.95
    reference: Optional[str] = None

    def __post_init__(self):
        if self.last_steps < 1:
            raise ValueError(f"last_steps={self.last_steps}: must be >= 1")
        if not 0 < self.confidence < 1:
            raise ValueError(f"confidence={self.confidence}: must be strictly between 0 and 1, e.g. 0.95")


def build_report(run_dirs: Sequence[str | Path], out_dir: str | Path,
                 options: ReportOptions = ReportOptions()) -> Path:
    """Write ``<out_dir>/report.md`` and its PNG figures; returns the report's path."""
    out = Path(out_dir)
    runs = load_runs(run_dirs, warmup_steps=options.warmup_steps)
    axes = varying_keys(runs)
    groups = group_replicates(runs, axes)
    reference = find_group(groups, options.reference) if options.reference is not None else groups[0]
    out.mkdir(parents=True, exist_ok=True)
    table_axes = [a for a in axes if a != "seed"]  # seeds are grouped, not a sweep axis
    md = [*overview_section(runs, groups, axes, options),
          *throughput_section(groups, table_axes, options.confidence),
          *learning_section(groups, options),
          *retention_section(groups, options.confidence),
          *evaluation_section(groups, options.confidence),
          *differences_section(groups, reference, options),
          *figures_section(groups, table_axes, out, options.confidence)]
    path = out / "report.md"
    path.write_text("\n".join(md))
    return path


# Each section is a list of Markdown blocks; the report joins them with newlines.

def overview_section(runs: Sequence[Run], groups: Sequence[RunGroup], axes: Sequence[str],
                     options: ReportOptions) -> list[str]:
    """Title, note, how runs are labelled and grouped, and the list of runs (and of groups of seeds)."""
    md = [f"# {options.title}\n"]
    if options.note:
        md.append(options.note.strip() + "\n")
    md.append(f"{len(runs)} run(s). Step statistics are means over the steps after the first "
              f"{options.warmup_steps} (warm-up); memory is the peak over all steps. Runs are labelled by the config "
              "keys that differ between them: "
              f"{', '.join(f'`{a}`' for a in axes) or 'none (labelled by directory)'}.\n")
    replicated = is_replicated(groups)
    if replicated:
        md.append(f"Runs that differ only in a seed key ({', '.join(f'`{k}`' for k in seed_keys(runs))}) are "
                  f"grouped as replicates: {len(groups)} group(s). " + interval_note(groups, options.confidence))
    md.append("| run | directory | steps |\n|---|---|---|\n" + "".join(
        row([r.label, f"`{r.path}`", r.summary["steps"]]) + "\n" for r in runs))
    if replicated:
        md.append("| group | seeds | runs |\n|---|---|---|\n" + "".join(
            row([g.label, ", ".join(str(s) for s in g.seeds), g.n]) + "\n" for g in groups))
    return md


def throughput_section(groups: Sequence[RunGroup], table_axes: Sequence[str], confidence: float) -> list[str]:
    """One throughput table, or one per sweep axis (split by the other axes' values)."""
    md = ["## Throughput and step time\n"]
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
    return md


def learning_section(groups: Sequence[RunGroup], options: ReportOptions) -> list[str]:
    last_steps = options.last_steps
    window = "last step" if last_steps == 1 else f"mean of the last {last_steps} logged values of each curve"
    return [f"## Learning ({window})\n",
            learning_table(groups, last_steps=last_steps, confidence=options.confidence)]


def retention_section(groups: Sequence[RunGroup], confidence: float) -> list[str]:
    """Mastery and retention over the whole run (nothing when no run logged retention)."""
    retention = retention_table(groups, confidence=confidence)
    if not retention:
        return []
    return ["## Mastery and retention (whole run)\n",
            "Means over every logged step. Retention is the accuracy, under the current policy, of prompts "
            "that were mastered (all rollouts correct) when last seen: on the mastered prompts that recur in "
            "a training batch (weighted by their number), and on the retention probe's extra rollouts of the "
            "previous step's mastered prompts (pooled). Hinge active: the share of mastered tokens whose "
            "log-ratio was past the hinge-KL's margin, over the steps that had mastered tokens (weighted by "
            "their share); PPO KL: the mean of old_logp - logp over each step's updates.\n",
            retention]


def evaluation_section(groups: Sequence[RunGroup], confidence: float) -> list[str]:
    """The final evaluation table and, where runs kept per-problem results, bootstrap intervals per run."""
    evals = eval_table(groups, confidence=confidence)
    if not evals:
        return []
    md = ["## Final evaluation\n", evals]
    problems = eval_problem_intervals(groups, confidence=confidence)
    if problems:
        md.append(f"Per run: {100 * confidence:g}% percentile-bootstrap intervals over the benchmark's problems "
                  "(problems resampled with replacement, 2000 draws, seed 0), for pass@1 and the unbiased "
                  "pass@k.\n")
        md.append(problems)
    return md


def differences_section(groups: Sequence[RunGroup], reference: RunGroup, options: ReportOptions) -> list[str]:
    """Every group against ``reference`` (only with several groups of seeds)."""
    if not (is_replicated(groups) and len(groups) > 1):
        return []
    confidence = options.confidence
    return [f"## Differences from `{reference.label}`\n",
            f"Difference of group means with Welch's {100 * confidence:g}% t-interval over seeds (unequal "
            "variances, Welch-Satterthwaite degrees of freedom): the seed-to-seed uncertainty. Rows marked "
            "'bootstrap over problems' give the other source for a benchmark: per problem, the difference "
            "of the seed-averaged scores, with a paired percentile bootstrap over the problems (2000 draws, "
            "seed 0). **Bold**: the interval excludes 0.\n",
            differences_table(groups, reference, last_steps=options.last_steps, confidence=confidence)]


def figures_section(groups: Sequence[RunGroup], table_axes: Sequence[str], out: Path,
                    confidence: float) -> list[str]:
    """Draw the figures into ``out``; link those drawn and name those without data."""
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
    md = ["## Figures\n"]
    for name, caption in FIGURES.items():
        if made[name] is not None:
            md.append(f"### {caption}\n\n![{caption}]({name})\n")
    missing = [FIGURES[n] for n, p in made.items() if p is None]
    if missing:
        md.append("Not drawn (no data in these runs): " + "; ".join(missing) + ".\n")
    return md


__all__ = ["build_report", "ReportOptions", "load_runs", "find_group", "FIGURES", "axis_value"]
