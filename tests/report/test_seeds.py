"""Seed aggregation end to end on a tiny sweep: launch.sweep writes the points of a seed x algorithm sweep (real
resolved configs), each run gets synthetic metrics and evaluation results, and `mcpo report` must group the
seeds and print means with Student-t / Welch intervals computed here from closed forms."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from launch import sweep
from md_tables import rows_by_label
from mcpo_megatron.cli import main as mcpo_main
from mcpo_megatron.report import plots
from mcpo_megatron.report.build import load_runs
from mcpo_megatron.report.groups import group_replicates
from mcpo_megatron.report.runs import varying_keys

REPO = Path(__file__).resolve().parents[2]
CPU_CONFIG = str(REPO / "configs" / "cpu_smollm2_arith.yaml")
T975_DF1 = math.tan(math.pi * 0.475)           # Student-t 0.975 quantile, 1 degree of freedom (closed form)
T975_DF2 = 0.95 / math.sqrt(2 * 0.975 * 0.025)  # ... 2 degrees of freedom
SEEDS = (1, 2)
STEPS = 4
BENCH = "arith:ops=+,digits=1|2/1"  # a "|" in a benchmark name must not split a Markdown cell


def _acc(alg: str, seed: int, step: int) -> float:
    return 0.1 * step + (0.1 if alg == "mcpo" else 0.0) + 0.02 * seed


def _records(alg: str, seed: int) -> list[dict]:
    out = []
    for s in range(1, STEPS + 1):
        out.append({
            "step": s, "acc/mean": _acc(alg, seed, s), "reward/mean": 2 * _acc(alg, seed, s) - 1,
            "mastery/mastered_frac": 0.05 * s + (0.05 * seed if alg == "mcpo" else 0.0),
            "mastery/all_wrong_frac": 0.5 - 0.1 * s,
            # retention: undefined at step 1; at later steps (value, number of recurring mastered prompts)
            "retention/acc": float("nan") if s == 1 else (0.9 if alg == "mcpo" else 0.7) + 0.01 * seed,
            "retention/prompts": 0 if s == 1 else s,
            "retention/probe_acc": float("nan") if s == 1 else 0.5 + 0.1 * seed,
            "retention/probe_samples": 0 if s == 1 else 4,
            # the hinge's activity, weighted by the share of mastered tokens (none at step 1); DAPO has no hinge
            **({"hkl/active_frac": 0.1 * s, "hkl/mastered_token_frac": 0.0 if s == 1 else 0.1 * s * seed}
               if alg == "mcpo" else {}),
            "actor/ppo_kl": 0.001 * s * seed,
            "time/rollout": 4.0, "time/train": 6.0 + seed, "time/step": 10.0 + seed if s > 1 else 100.0,
            "perf/tokens_per_s_per_gpu": 100.0 * seed, "memory/peak_gib": 1.0 + seed,
        })
    return out


def _write_eval(run_dir: Path, alg: str, seed: int) -> None:
    from mcpo_megatron.evaluation import benchmark_result, write_results

    # 4 problems x 4 samples; correct counts [4, 2, seed, 0] (+1 on the last problem for MCPO)
    counts = [4, 2, seed, 1 if alg == "mcpo" else 0]
    correct = [[1] * c + [0] * (4 - c) for c in counts]
    res = benchmark_result(BENCH, correct, k=4, uids=[f"p{i}" for i in range(4)], golds=["1", "2", "3", "4"])
    write_results({"step_4": {BENCH: res}}, run_dir / "eval")


@pytest.fixture()
def seed_sweep(tmp_path):
    """A 2-seed x 2-algorithm sweep prepared by launch.sweep (resolved configs, sweep_point.json)."""
    root = tmp_path / "sweep"
    _, axes = sweep.parse_axes("1", ["seed=1,2", "algorithm.name=mcpo,dapo"])
    points = sweep.make_points([1], axes)
    assert sweep.prepare_points(points, CPU_CONFIG, ["algorithm.filter_groups.enable=false"], root,
                                gpus_per_node=2) == []
    for p in points:
        d = Path(p["run_dir"])
        alg = "mcpo" if "mcpo" in p["label"] else "dapo"
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _records(alg, p["seed"])))
        _write_eval(d, alg, p["seed"])
    return root


def _pm(values, spec=".3f", t=T975_DF1) -> str:
    """``mean ± half`` of the Student-t interval, computed here."""
    n = len(values)
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    return f"{format(mean, spec)} ± {format(t * sd / math.sqrt(n), spec)}"


def test_runs_differing_only_by_seed_form_groups(seed_sweep):
    runs = load_runs(sorted(p for p in seed_sweep.iterdir() if (p / "metrics.jsonl").is_file()))
    axes = varying_keys(runs)
    assert axes == ["algorithm", "seed"]  # trainer.seed and rollout.seed are one pseudo-key
    assert {r.label for r in runs} == {"algorithm=mcpo seed=1", "algorithm=mcpo seed=2",
                                       "algorithm=dapo (filter_groups.enable=False) seed=1",
                                       "algorithm=dapo (filter_groups.enable=False) seed=2"}
    groups = group_replicates(runs, axes)
    assert [(g.label, g.seeds) for g in groups] == [
        ("algorithm=dapo (filter_groups.enable=False)", ["1", "2"]), ("algorithm=mcpo", ["1", "2"])]
    # Bands: the mean and t-interval over the seeds at every step; none where fewer than two seeds logged.
    steps, means, lows, highs = plots.band(groups[1], "acc/mean")
    assert steps == [1, 2, 3, 4]
    vals = [_acc("mcpo", 1, 3), _acc("mcpo", 2, 3)]
    half = T975_DF1 * abs(vals[1] - vals[0]) / math.sqrt(2) / math.sqrt(2)
    assert means[2] == pytest.approx(sum(vals) / 2) and highs[2] - means[2] == pytest.approx(half)
    one_seed = [g.runs[0] for g in groups]  # seed 1 of each algorithm: groups of one, no band
    assert plots.band(group_replicates(one_seed, ["algorithm"])[0], "acc/mean")[2] == [None] * 4


def test_report_shows_means_and_intervals_over_seeds(seed_sweep, tmp_path):
    out = tmp_path / "report"
    assert mcpo_main(["report", str(seed_sweep), "--out", str(out), "--last-steps", "2", "--reference", "dapo"]) == 0
    md = (out / "report.md").read_text()
    mcpo, dapo = "algorithm=mcpo", "algorithm=dapo (filter_groups.enable=False)"
    assert "grouped as replicates: 2 group(s)" in md and "95% Student-t interval over seeds" in md
    assert "`trainer.seed`, `rollout.seed`" in md
    assert rows_by_label(md, "| group | seeds | runs |")[mcpo] == [mcpo, "1, 2", "2"]

    # Learning: mean of the last 2 steps per run, then mean ± t-interval over the 2 seeds.
    learn = rows_by_label(md, "| run | seeds | steps | accuracy")
    acc = [(_acc("mcpo", s, 3) + _acc("mcpo", s, 4)) / 2 for s in SEEDS]
    assert learn[mcpo][1:3] == ["2", "4"]
    assert learn[mcpo][3] == _pm(acc)
    assert learn[dapo][3] == _pm([(_acc("dapo", s, 3) + _acc("dapo", s, 4)) / 2 for s in SEEDS])

    # Retention over the whole run: weighted by recurring prompts; probe pooled; totals.
    ret = rows_by_label(md, "| run | seeds | mastered (mean over steps)")
    assert ret[mcpo][4] == _pm([0.9 + 0.01 * s for s in SEEDS])   # retention on recurring prompts
    assert ret[mcpo][5] == "9.0 ± 0.0"                             # 2 + 3 + 4 recurring prompts in each seed
    assert ret[mcpo][6] == _pm([0.5 + 0.1 * s for s in SEEDS])    # probe accuracy
    assert ret[mcpo][7] == "12 ± 0"                                # 3 steps x 4 probe samples
    assert ret[mcpo][2] == _pm([sum(0.05 * t + 0.05 * s for t in range(1, 5)) / 4 for s in SEEDS])
    # hinge activity weighted by mastered tokens: sum(0.1 t * 0.1 t seed) / sum(0.1 t seed) over t = 2..4,
    # the same for every seed
    hinge = sum(0.01 * t * t for t in range(2, 5)) / sum(0.1 * t for t in range(2, 5))
    assert ret[mcpo][8] == f"{hinge:.3f} ± 0.000" and ret[dapo][8] == "–"
    assert ret[dapo][9] == _pm([sum(0.001 * t * s for t in range(1, 5)) / 4 for s in SEEDS], ".2e")

    # Throughput: step time after the warm-up step, tokens/s/GPU, peak memory, each over seeds.
    perf = rows_by_label(md, "| run | algorithm | seeds | nodes | ranks | step s")
    assert perf[mcpo][2:5] == ["2", "1", "2"]
    assert perf[mcpo][5] == _pm([11.0, 12.0], ".2f")
    assert perf[mcpo][8] == _pm([100.0, 200.0], ".1f")
    assert perf[mcpo][-1] == _pm([2.0, 3.0], ".2f")

    # Final evaluation: pass@1 and unbiased pass@4 over seeds; per-run bootstrap intervals over problems.
    ev = rows_by_label(md, "| group | benchmark | seeds | problems | pass@1")
    p1 = [(6 + s + 1) / 16 for s in SEEDS]
    assert ev[mcpo][1:4] == [BENCH, "2", "4"] and ev[mcpo][4] == _pm(p1, ".4f")
    assert f"| {mcpo} | arith:ops=+,digits=1\\|2/1 | 2 | 4 |" in md  # the pipe is escaped in the file
    # pass@4 from 4 samples: the fraction of problems with any correct sample (counts [4, 2, seed, 1 | 0])
    assert ev[mcpo][5] == "1.0000 ± 0.0000" and ev[dapo][5] == "0.7500 ± 0.0000" and ev[mcpo][6] == "4"
    per_run = rows_by_label(md, "| run | benchmark | problems | pass@1 | 95% CI")
    assert len(per_run) == 4 and per_run["algorithm=mcpo seed=1"][3] == f"{8 / 16:.4f}"

    # Differences from the reference (dapo): Welch intervals; equal spreads give 2 degrees of freedom here.
    diff = rows_by_label(md, f"| metric | {mcpo} − {dapo} |")
    d_acc = diff["accuracy (last 2 steps)"][1]
    half = T975_DF2 * math.sqrt(2 * 0.02 ** 2 / 2 / 2)
    assert d_acc == f"**{0.1:+.3f} [{0.1 - half:+.3f}, {0.1 + half:+.3f}]**"  # excludes 0: bold
    assert not diff["all-wrong (last 2 steps)"][1].startswith("**")        # identical: [0, 0] ... not bold
    assert diff[f"{BENCH} pass@1"][1].startswith(f"{1 / 16:+.4f}")
    # The paired bootstrap over problems of the seed-averaged scores: only problem 4 differs (1 of 4 samples
    # correct for MCPO, 0 for DAPO), so pass@1 differs by 1/4 there and pass@4 by 1; the means over 4 problems.
    assert diff[f"{BENCH} pass@1, bootstrap over problems"][1].startswith("+0.0625 [+0.0000, ")
    assert diff[f"{BENCH} pass@4 (unbiased), bootstrap over problems"][1].startswith("+0.2500 [+0.0000, ")

    for name in ("reward_acc.png", "mastery.png", "retention.png", "time_split.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"]({name})" in md
    assert "band: 95% t-interval" not in md  # the caption lives in the figure, the report names the figure


def test_reference_errors(seed_sweep, tmp_path, capsys):
    assert mcpo_main(["report", str(seed_sweep), "--out", str(tmp_path / "o"), "--reference", "grpo"]) == 1
    assert "matches no group" in capsys.readouterr().err
    assert mcpo_main(["report", str(seed_sweep), "--out", str(tmp_path / "o"), "--reference", "algorithm"]) == 1
    assert "matches several groups" in capsys.readouterr().err
    assert mcpo_main(["report", str(seed_sweep), "--out", str(tmp_path / "o"), "--last-steps", "0"]) == 2
    assert mcpo_main(["report", str(seed_sweep), "--out", str(tmp_path / "o"), "--confidence", "1.5"]) == 2
