"""Markdown tables of a report: throughput and time split per sweep axis, learning, retention and final evaluation
(Table 1 layout); the differences between groups are in ``differences.py``.

Every table has one row per group (``groups.RunGroup``). A group of one run shows that run's values; a group of
seeds shows ``mean ± h``, where h is the half-width of the Student-t interval over its seeds (``stats``).
"""

from __future__ import annotations

import json
import math
from typing import Any, Callable, Optional, Sequence

from mcpo_megatron.report.groups import Metric, RunGroup, is_replicated
from mcpo_megatron.report.runs import Run
from mcpo_megatron.report.stats import Interval, bootstrap_mean_interval, per_problem_pass_at_k

# Phases of a step, in loop order, as logged by the trainer's StepTimer (time/<phase>).
PHASES = ("rollout", "retention_probe", "reward", "old_logprobs", "train", "reshard", "eval", "checkpoint")
# Learning curves: (metric key, column name).
LEARNING_KEYS = (("acc/mean", "accuracy"), ("reward/mean", "reward"), ("mastery/mastered_frac", "mastered"),
                 ("mastery/all_wrong_frac", "all-wrong"), ("retention/acc", "retention"),
                 ("actor/entropy", "entropy"), ("response/length_mean", "resp. length"))


def phases_of(runs: Sequence[Run]) -> list[str]:
    """Timed phases present in any run: the known ones in loop order, then any other ``time/*`` key."""
    seen = {k[len("time/"):] for r in runs for k in r.summary.get("mean", {}) if k.startswith("time/")}
    seen.discard("step")
    return [p for p in PHASES if p in seen] + sorted(seen - set(PHASES))


def row(cells: Sequence[Any]) -> str:
    """A Markdown table row; a ``|`` inside a cell (``digits=1|2/1``) is escaped so it does not split the cell."""
    return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"


def fmt(x: Optional[float], spec: str = ".3g") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "–"
    return format(x, spec)


def fmt_interval(iv: Optional[Interval], spec: str = ".3f") -> str:
    """``0.512`` for one value, ``0.512 ± 0.034`` (mean ± half-width) over several, ``–`` for none."""
    if iv is None:
        return "–"
    if iv.half_width is None:
        return fmt(iv.mean, spec)
    return f"{fmt(iv.mean, spec)} ± {fmt(iv.half_width, spec)}"


def fmt_difference(iv: Optional[Interval], spec: str = "+.3f") -> str:
    """``+0.050 [-0.010, +0.110]``, in bold when the interval excludes 0."""
    if iv is None:
        return "–"
    if iv.low is None or iv.high is None:
        return f"{format(iv.mean, spec)} (no interval: one seed)"
    text = f"{format(iv.mean, spec)} [{format(iv.low, spec)}, {format(iv.high, spec)}]"
    return f"**{text}**" if iv.excludes_zero() else text


def interval_note(groups: Sequence[RunGroup], confidence: float) -> str:
    """The sentence that says what a ``±`` means, for reports with seed groups."""
    sizes = sorted({g.n for g in groups})
    return (f"Cells are mean ± half-width of the {100 * confidence:g}% Student-t interval over seeds "
            f"(t quantile with n-1 degrees of freedom × sample std / √n; n = {'/'.join(map(str, sizes))} seeds "
            "per group); a run without the metric is left out of its group's mean.\n")


# ---------------------------------------------------------------------------------------------- per-run metrics
def tokens_per_s_per_gpu(run: Run) -> tuple[Optional[float], str]:
    """Throughput per device: the accounting's ``perf/tokens_per_s_per_gpu`` (prompt + response tokens of the
    trained sequences) when logged, else the generated tokens per second of step time / world size
    (``perf/generated_tokens_per_step_s``; runs older than that key logged this figure under
    ``perf/generated_tokens_per_s``, now the rate over generation time only). Returns (value, source note)."""
    v = run.mean("perf/tokens_per_s_per_gpu")
    if v is not None:
        return v, ""
    total = run.mean("perf/generated_tokens_per_step_s")
    if total is None:
        total = run.mean("perf/generated_tokens_per_s")
    if total is not None:
        return total / (run.world_size or 1), "*"
    return None, ""


def last_values(key: str, last_steps: int) -> Metric:
    """The mean of a run's last ``last_steps`` logged (finite) values of ``key``; 1 = the last value."""
    def metric(run: Run) -> Optional[float]:
        _, ys = run.series(key)
        return sum(ys[-last_steps:]) / len(ys[-last_steps:]) if ys else None

    return metric


def over_run(key: str, weight_key: Optional[str] = None) -> Metric:
    """The mean of ``key`` over every step that logged it, weighted by ``weight_key`` when given (e.g. the number
    of prompts a retention value averages over)."""
    def metric(run: Run) -> Optional[float]:
        num = den = 0.0
        for rec in run.records:
            v, w = rec.get(key), rec.get(weight_key, 1.0) if weight_key else 1.0
            if _finite(v) and _finite(w) and w > 0:
                num += float(v) * float(w)
                den += float(w)
        return num / den if den > 0 else None

    return metric


def total(key: str) -> Metric:
    def metric(run: Run) -> Optional[float]:
        vals = [float(rec[key]) for rec in run.records if _finite(rec.get(key))]
        return sum(vals) if vals else None

    return metric


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def step_mean(key: str) -> Metric:
    return lambda run: run.mean(key)


def peak_memory(run: Run) -> Optional[float]:
    return run.summary.get("max", {}).get("memory/peak_gib")


# ---------------------------------------------------------------------------------------------- throughput
def scaling_efficiency(groups: Sequence[RunGroup]) -> dict[int, Optional[float]]:
    """Per group (by id): mean tokens/s/GPU divided by that of the group with the fewest devices (ties: fewest
    nodes, then first given). 1.0 is perfect weak/strong scaling of per-device throughput."""
    def size(g: RunGroup) -> tuple:
        return (g.runs[0].world_size or 0, g.runs[0].nodes or 0)

    def mean_tp(g: RunGroup) -> Optional[float]:
        iv = g.interval(lambda r: tokens_per_s_per_gpu(r)[0])
        return iv.mean if iv else None

    base_tp = mean_tp(min(groups, key=size))
    out: dict[int, Optional[float]] = {}
    for g in groups:
        tp = mean_tp(g)
        out[id(g)] = tp / base_tp if tp is not None and base_tp else None
    return out


def group_by_others(groups: Sequence[RunGroup], axis: str, axes: Sequence[str]) -> list[tuple[str, list[RunGroup]]]:
    """Groups grouped by their values of every varying key except ``axis`` (and ``seed``); each sorted along
    ``axis``."""
    out: dict[str, list[RunGroup]] = {}
    for g in groups:
        key = " ".join(f"{k.rsplit('.', 1)[-1]}={g.value(k)}" for k in axes if k not in (axis, "seed"))
        out.setdefault(key, []).append(g)

    def order(g: RunGroup):
        v = g.value(axis)
        return (0, v, "") if isinstance(v, (int, float)) and not isinstance(v, bool) else (1, 0, json.dumps(v, default=str))

    return [(k, sorted(v, key=order)) for k, v in out.items()]


def perf_table(groups: Sequence[RunGroup], *, axis_name: Optional[str] = None, confidence: float = 0.95) -> str:
    """One row per group: cluster shape, mean step time and its split, tokens/s/GPU, achieved TFLOP/s/GPU, MFU,
    scaling efficiency relative to the smallest group of the table, peak memory."""
    if axis_name == "nodes":  # already a column
        axis_name = None
    runs = [r for g in groups for r in g.runs]
    phases = phases_of(runs)
    eff = scaling_efficiency(groups)
    has_mfu = any(r.mean("perf/mfu") is not None for r in runs)
    seeds = is_replicated(groups)
    head = ["run"] + ([axis_name] if axis_name else []) + (["seeds"] if seeds else []) + [
        "nodes", "ranks", "step s"] + [f"{p} s" for p in phases] + ["tokens/s/GPU", "TFLOP/s/GPU"] + (
        ["MFU %"] if has_mfu else []) + ["scaling eff.", "peak mem GiB"]
    lines = [row(head), "|" + "---|" * len(head)]
    note = False

    def cell(metric: Metric, spec: str) -> str:
        return fmt_interval(g.interval(metric, confidence), spec)

    for g in groups:
        first = g.runs[0]
        src = "".join(sorted({tokens_per_s_per_gpu(r)[1] for r in g.runs}))
        note = note or bool(src)
        cells = [g.label] + ([str(g.value(axis_name))] if axis_name else []) + ([str(g.n)] if seeds else []) + [
            fmt(first.nodes, "d") if first.nodes is not None else "–",
            fmt(first.world_size, "d") if first.world_size is not None else "–",
            cell(step_mean("time/step"), ".2f")] + [cell(step_mean(f"time/{p}"), ".2f") for p in phases] + [
            cell(lambda r: tokens_per_s_per_gpu(r)[0], ".1f") + src,
            cell(step_mean("perf/achieved_tflops_per_s_per_gpu"), ".4g")] + (
            [cell(lambda r: 100 * r.mean("perf/mfu") if r.mean("perf/mfu") is not None else None, ".1f")]
            if has_mfu else []) + [fmt(eff[id(g)], ".2f"), cell(peak_memory, ".2f")]
        lines.append(row(cells))
    text = "\n".join(lines) + "\n"
    if note:
        text += ("\n\\* no `perf/tokens_per_s_per_gpu` in this run's metrics: generated tokens/s "
                 "(`perf/tokens_per_s`) divided by the ranks.\n")
    return text


# ---------------------------------------------------------------------------------------------- learning
def learning_table(groups: Sequence[RunGroup], *, last_steps: int = 1, confidence: float = 0.95) -> str:
    """The learning curves at the end of training: per run the mean of the last ``last_steps`` logged values of
    each curve (1: the last value), per group the mean and interval over seeds."""
    runs = [r for g in groups for r in g.runs]
    keys = [(k, n) for k, n in LEARNING_KEYS if any(r.series(k)[0] for r in runs)]
    seeds = is_replicated(groups)
    head = ["run"] + (["seeds"] if seeds else []) + ["steps"] + [n for _, n in keys]
    lines = [row(head), "|" + "---|" * len(head)]
    for g in groups:
        steps = sorted({r.summary["steps"] for r in g.runs})
        lines.append(row([g.label] + ([str(g.n)] if seeds else []) + ["/".join(map(str, steps))] + [
            fmt_interval(g.interval(last_values(k, last_steps), confidence)) for k, _ in keys]))
    return "\n".join(lines) + "\n"


RETENTION_COLUMNS: tuple[tuple[str, Callable[[], Metric], str], ...] = (
    ("mastered (mean over steps)", lambda: over_run("mastery/mastered_frac"), ".3f"),
    ("all-wrong (mean over steps)", lambda: over_run("mastery/all_wrong_frac"), ".3f"),
    ("retention on recurring prompts", lambda: over_run("retention/acc", "retention/prompts"), ".3f"),
    ("recurring mastered prompts", lambda: total("retention/prompts"), ".1f"),
    ("retention probe acc", lambda: over_run("retention/probe_acc", "retention/probe_samples"), ".3f"),
    ("probe samples", lambda: total("retention/probe_samples"), ".0f"),
    # how much MCPO's hinge-KL had to act: the share of mastered tokens past its margin, over the steps that had
    # such tokens, and how far the policy moved within a step (mean of old_logp - logp over the updates)
    ("hinge active (share of mastered tokens)", lambda: over_run("hkl/active_frac", "hkl/mastered_token_frac"),
     ".3f"),
    ("PPO KL (mean over steps)", lambda: over_run("actor/ppo_kl"), ".2e"),
)


def retention_table(groups: Sequence[RunGroup], *, confidence: float = 0.95) -> Optional[str]:
    """Mastery and retention over the whole run (the paper's Figs. 5 and 7 as numbers); None when no run logged
    retention. Retention is the accuracy, under the current policy, of prompts mastered when last seen: on the
    prompts that recur in a batch (weighted by their number) and on the probe's extra rollouts (pooled)."""
    runs = [r for g in groups for r in g.runs]
    if not any(r.series("retention/acc")[0] or r.series("retention/probe_acc")[0] for r in runs):
        return None
    cols = [(name, make(), spec) for name, make, spec in RETENTION_COLUMNS
            if any(make()(r) is not None for r in runs)]
    seeds = is_replicated(groups)
    head = ["run"] + (["seeds"] if seeds else []) + [name for name, _, _ in cols]
    lines = [row(head), "|" + "---|" * len(head)]
    for g in groups:
        lines.append(row([g.label] + ([str(g.n)] if seeds else []) + [
            fmt_interval(g.interval(m, confidence), spec) for _, m, spec in cols]))
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------- evaluation
def benchmarks_of(runs: Sequence[Run]) -> list[str]:
    """The benchmarks any of ``runs`` was evaluated on, in the order first seen."""
    out: list[str] = []
    for r in runs:
        out += [b for b in r.evals if b not in out]
    return out


def eval_metric(bench: str, which: str) -> Metric:
    """``which`` in pass@1 | pass@k (unbiased) | bootstrap (verl's best@k) of a benchmark, from ``eval_results.json``
    or the last periodic evaluation in metrics.jsonl."""
    from mcpo_megatron.evaluation import BenchmarkResult

    def metric(run: Run) -> Optional[float]:
        res = run.evals.get(bench)
        if isinstance(res, BenchmarkResult):
            return {"pass@1": res.pass_at_1, "pass@k": res.pass_at_k, "bootstrap": res.bootstrap_pass_at_k}[which]
        if not isinstance(res, dict):
            return None
        if which == "pass@1":
            return res.get("pass@1")
        k = _flat_k(res)
        return res.get(f"pass@{k}" if which == "pass@k" else f"bootstrap_pass@{k}") if k else None

    return metric


def _flat_k(res: dict) -> Optional[str]:
    ks = sorted((m.split("@", 1)[1] for m in res if m.startswith("pass@") and m != "pass@1"), key=_num_or_text)
    return ks[-1] if ks else None


def _num_or_text(s: str):
    return (0, int(s), "") if s.isdigit() else (1, 0, s)


def eval_k_label(runs: Sequence[Run], bench: str) -> str:
    """The k of ``bench``'s pass@k over ``runs`` ("8", or "4/8" when they differ; "k" when none says)."""
    from mcpo_megatron.evaluation import BenchmarkResult

    ks = set()
    for r in runs:
        res = r.evals.get(bench)
        if isinstance(res, BenchmarkResult):
            ks.add(str(res.k))
        elif isinstance(res, dict) and _flat_k(res):
            ks.add(_flat_k(res))
    return "/".join(sorted(ks, key=_num_or_text)) or "k"


def eval_table(groups: Sequence[RunGroup], *, confidence: float = 0.95) -> Optional[str]:
    """Final evaluation: the paper's Table 1 layout (rows: runs, columns: benchmarks, cells pass@1/pass@k) when
    every group is one run; with seed groups, one row per group and benchmark with pass@1, unbiased pass@k and
    verl's bootstrap best@k as mean ± interval over seeds. None when no run has evaluation results."""
    runs = [r for g in groups for r in g.runs]
    with_evals = [r for r in runs if r.evals]
    if not with_evals:
        return None
    from mcpo_megatron.evaluation import BenchmarkResult, markdown_table
    from mcpo_megatron.evaluation.report import DISPLAY_NAMES, format_score

    benches = benchmarks_of(with_evals)
    if is_replicated(groups):
        lines = ["| group | benchmark | seeds | problems | pass@1 | pass@k (unbiased) | k | bootstrap best@k |",
                 "|---|---|---|---|---|---|---|---|"]
        for g in groups:
            for b in benches:
                have = [r for r in g.runs if b in r.evals]
                if not have:
                    continue
                problems = sorted({int(r.evals[b].num_problems) if isinstance(r.evals[b], BenchmarkResult)
                                   else int(r.evals[b].get("num_problems", 0)) for r in have})
                lines.append(row([
                    g.label, DISPLAY_NAMES.get(b, b), str(len(have)), "/".join(map(str, problems)) or "–",
                    fmt_interval(g.interval(eval_metric(b, "pass@1"), confidence), ".4f"),
                    fmt_interval(g.interval(eval_metric(b, "pass@k"), confidence), ".4f"), eval_k_label(have, b),
                    fmt_interval(g.interval(eval_metric(b, "bootstrap"), confidence), ".4f")]))
        return "\n".join(lines) + "\n"
    if all(isinstance(v, BenchmarkResult) for r in with_evals for v in r.evals.values()):
        return markdown_table({r.label: r.evals for r in with_evals})
    # Periodic evaluation logged in metrics.jsonl (eval/<benchmark>/pass@1, pass@k): the same layout from
    # the flat metrics.
    ks = sorted({_flat_k(v) for r in with_evals for v in r.evals.values() if isinstance(v, dict) and _flat_k(v)},
                key=_num_or_text)
    k = ks[-1] if ks else None

    def cell(v: Any) -> str:
        if not isinstance(v, dict) or "pass@1" not in v:
            return "–"
        return format_score(v["pass@1"]) + (f"/{format_score(v[f'pass@{k}'])}" if k and f"pass@{k}" in v else "")

    lines = ["pass@1" + (f" / pass@{k}" if k else "") + " (unbiased estimator; last periodic evaluation)\n",
             "| " + row([DISPLAY_NAMES.get(b, b) for b in benches]), "|---" * (len(benches) + 1) + "|"]
    for r in with_evals:
        lines.append(row([r.label] + [cell(r.evals.get(b)) for b in benches]))
    return "\n".join(lines) + "\n"


def eval_problem_intervals(groups: Sequence[RunGroup], *, confidence: float = 0.95, n_boot: int = 2000) -> Optional[str]:
    """Per run and benchmark: pass@1 and unbiased pass@k with percentile-bootstrap intervals over the problems
    (resampled with replacement, ``n_boot`` draws, seed 0). Needs the per-problem counts of ``eval_results.json``;
    None when no run has them."""
    from mcpo_megatron.evaluation import BenchmarkResult
    from mcpo_megatron.evaluation.report import DISPLAY_NAMES

    rows = []
    for g in groups:
        for r in g.runs:
            for b, res in r.evals.items():
                if not isinstance(res, BenchmarkResult) or not res.per_problem:
                    continue
                correct = [int(p["correct"]) for p in res.per_problem]
                ns = [int(p["n"]) for p in res.per_problem]
                p1 = bootstrap_mean_interval(per_problem_pass_at_k(correct, ns, 1), confidence=confidence,
                                             n_boot=n_boot)
                pk = bootstrap_mean_interval(per_problem_pass_at_k(correct, ns, res.k), confidence=confidence,
                                             n_boot=n_boot)
                rows.append(row([
                    r.label, DISPLAY_NAMES.get(b, b), str(len(correct)), f"{p1.mean:.4f}",
                    f"[{p1.low:.4f}, {p1.high:.4f}]", f"{pk.mean:.4f}", f"[{pk.low:.4f}, {pk.high:.4f}]",
                    str(res.k)]))
    if not rows:
        return None
    pct = f"{100 * confidence:g}%"
    return "\n".join([f"| run | benchmark | problems | pass@1 | {pct} CI | pass@k (unbiased) | {pct} CI | k |",
                      "|---|---|---|---|---|---|---|---|", *rows]) + "\n"
