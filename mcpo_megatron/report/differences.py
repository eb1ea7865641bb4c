"""The differences between groups of a report: each metric's ``<group> − <reference>`` with Welch's t interval
over seeds, and for benchmarks with per-problem results a paired bootstrap over problems (``stats``)."""

from __future__ import annotations

from typing import Optional, Sequence

from mcpo_megatron.report.groups import Metric, RunGroup
from mcpo_megatron.report.runs import Run
from mcpo_megatron.report.stats import Interval, bootstrap_mean_interval, per_problem_pass_at_k, welch_interval
from mcpo_megatron.report.tables import (benchmarks_of, eval_k_label, eval_metric, fmt_difference, last_values,
                                         over_run, row)


def comparison_metrics(runs: Sequence[Run], last_steps: int) -> list[tuple[str, Metric, str]]:
    """The metrics a between-group comparison shows: (name, per-run metric, number format)."""
    window = "last step" if last_steps == 1 else f"last {last_steps} steps"
    out: list[tuple[str, Metric, str]] = [
        (f"accuracy ({window})", last_values("acc/mean", last_steps), "+.3f"),
        (f"mastered ({window})", last_values("mastery/mastered_frac", last_steps), "+.3f"),
        (f"all-wrong ({window})", last_values("mastery/all_wrong_frac", last_steps), "+.3f"),
        ("mastered (mean over steps)", over_run("mastery/mastered_frac"), "+.3f"),
        ("all-wrong (mean over steps)", over_run("mastery/all_wrong_frac"), "+.3f"),
        ("retention on recurring prompts", over_run("retention/acc", "retention/prompts"), "+.3f"),
        ("retention probe acc", over_run("retention/probe_acc", "retention/probe_samples"), "+.3f"),
    ]
    for b in benchmarks_of(runs):
        k = eval_k_label(runs, b)
        out += [(f"{b} pass@1", eval_metric(b, "pass@1"), "+.4f"),
                (f"{b} pass@{k} (unbiased)", eval_metric(b, "pass@k"), "+.4f")]
    return [(n, m, s) for n, m, s in out if any(m(r) is not None for r in runs)]


def seed_averaged_problems(group: RunGroup, bench: str, k: int) -> Optional[dict[str, float]]:
    """Per problem (uid): the unbiased pass@k averaged over the group's runs; None unless every run has
    per-problem results for ``bench`` on the same problems."""
    from mcpo_megatron.evaluation import BenchmarkResult

    per_run = []
    for r in group.runs:
        res = r.evals.get(bench)
        if not isinstance(res, BenchmarkResult) or not res.per_problem or any(p["n"] < k for p in res.per_problem):
            return None
        uids = [p["uid"] for p in res.per_problem]
        vals = per_problem_pass_at_k([p["correct"] for p in res.per_problem], [p["n"] for p in res.per_problem], k)
        per_run.append(dict(zip(uids, vals.tolist())))
    if not per_run or any(set(d) != set(per_run[0]) for d in per_run):
        return None
    return {u: sum(d[u] for d in per_run) / len(per_run) for u in per_run[0]}


def paired_problem_difference(a: RunGroup, b: RunGroup, bench: str, k: int, confidence: float = 0.95,
                              n_boot: int = 2000) -> Optional[Interval]:
    """``a − b`` on a benchmark both evaluated on the same problems: per problem the difference of the
    seed-averaged pass@k, with a percentile-bootstrap interval over problems (paired: one resample of problems
    serves both groups). This is the problem-sampling uncertainty; the Welch rows give the seed-to-seed one."""
    pa, pb = seed_averaged_problems(a, bench, k), seed_averaged_problems(b, bench, k)
    if pa is None or pb is None or set(pa) != set(pb):
        return None
    uids = sorted(pa)
    return bootstrap_mean_interval([pa[u] - pb[u] for u in uids], confidence=confidence, n_boot=n_boot)


def _result_k(runs: Sequence[Run], bench: str) -> Optional[int]:
    from mcpo_megatron.evaluation import BenchmarkResult

    ks = {r.evals[bench].k for r in runs if isinstance(r.evals.get(bench), BenchmarkResult)}
    return ks.pop() if len(ks) == 1 else None


def differences_table(groups: Sequence[RunGroup], reference: RunGroup, *, last_steps: int = 1,
                      confidence: float = 0.95) -> Optional[str]:
    """Rows: metrics; columns: ``<group> − <reference>``, the difference of the group means with Welch's t
    interval over seeds (bold when it excludes 0), and for benchmarks with per-problem results the paired
    bootstrap over problems of the seed-averaged scores. None with fewer than two groups."""
    others = [g for g in groups if g is not reference]
    if not others:
        return None
    runs = [r for g in groups for r in g.runs]
    head = ["metric"] + [f"{g.label} − {reference.label}" for g in others]
    lines = [row(head), "|" + "---|" * len(head)]
    for name, metric, spec in comparison_metrics(runs, last_steps):
        lines.append(row([name] + [
            fmt_difference(welch_interval(g.values(metric), reference.values(metric), confidence), spec)
            for g in others]))
    for b in benchmarks_of(runs):
        k = _result_k(runs, b)
        for kk in ([1, k] if k and k > 1 else [1] if k else []):
            cells = [paired_problem_difference(g, reference, b, kk, confidence) for g in others]
            if any(c is not None for c in cells):
                what = "pass@1" if kk == 1 else f"pass@{kk} (unbiased)"
                lines.append(row([f"{b} {what}, bootstrap over problems"] + [
                    fmt_difference(c, "+.4f") for c in cells]))
    return "\n".join(lines) + "\n"
