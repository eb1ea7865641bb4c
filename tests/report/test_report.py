"""`mcpo report` on synthetic run directories written here: table values, labels, figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from md_tables import table_rows

from mcpo_megatron.cli import main as mcpo_main


def _config(algorithm: str, out: str) -> dict:
    return {"model": {"path": "builtin:smollm2-135m-instruct"}, "algorithm": {"name": algorithm, "clip": 0.2},
            "trainer": {"output_dir": out, "total_steps": 4}, "data": {"train_batch_size": 8}}


def _records(nodes: int, algorithm: str, steps: int = 4) -> list[dict]:
    """Step records whose per-step numbers are simple functions of (nodes, algorithm, step)."""
    out = []
    for s in range(1, steps + 1):
        boost = 0.1 if algorithm == "mcpo" else 0.0
        out.append({
            "step": s,
            "acc/mean": 0.2 + 0.1 * s + boost, "reward/mean": -0.6 + 0.2 * s,
            "mastery/mastered_frac": 0.1 * s, "mastery/all_wrong_frac": 0.5 - 0.1 * s,
            "retention/acc": 0.9 if s > 1 else float("nan"), "actor/entropy": 1.0 - 0.1 * s,
            "response/length_mean": 10.0 + s, "batch/sequences": 16,
            # warm-up step 1 is slow; steady state: step time 10/nodes s, tokens/s/GPU 100 (1 node), 80 (2)
            "time/rollout": 4.0 / nodes if s > 1 else 40.0, "time/train": 6.0 / nodes if s > 1 else 60.0,
            "time/step": 10.0 / nodes if s > 1 else 100.0,
            "perf/tokens_per_s_per_gpu": (100.0 if nodes == 1 else 80.0) if s > 1 else 1.0,
            "perf/achieved_tflops_per_s_per_gpu": 0.5 * (1 if nodes == 1 else 0.8),
            "memory/peak_gib": 2.0 * s / nodes,
        })
    return out


def _write_run(root: Path, nodes: int, algorithm: str, *, evals: bool) -> Path:
    d = root / f"nodes{nodes}_{algorithm}"
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(yaml.safe_dump(_config(algorithm, str(d))))
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _records(nodes, algorithm)))
    (d / "summary.json").write_text(json.dumps({"nodes": nodes, "world_size": 2 * nodes}))
    if evals:
        from mcpo_megatron.evaluation import BenchmarkResult, write_results

        res = {b: BenchmarkResult(name=b, num_problems=30, samples_per_problem=8, k=8, pass_at_1=p1,
                                  pass_at_k=pk, bootstrap_pass_at_k=pk - 0.01, mean_response_length=100.0,
                                  length_unit="tokens", truncation_rate=0.0, status_counts={"ok": 240})
               for b, p1, pk in (("aime_2024", 0.25 if algorithm == "mcpo" else 0.2, 0.5),
                                 ("amc_2023", 0.6, 0.9))}
        write_results({"model": res}, d)
    return d


@pytest.fixture()
def sweep(tmp_path):
    root = tmp_path / "sweep"
    for nodes in (1, 2):
        for alg in ("mcpo", "dapo"):
            _write_run(root, nodes, alg, evals=(nodes == 2))
    return root


def test_report_tables_and_figures(sweep, tmp_path):
    out = tmp_path / "report"
    assert mcpo_main(["report", str(sweep), "--out", str(out), "--title", "Synthetic"]) == 0
    md = (out / "report.md").read_text()

    # Labels come from the keys that differ (nodes and algorithm.name), not from paths or common keys.
    assert "`nodes`, `algorithm`" in md
    assert "clip=" not in md and "output_dir=" not in md

    rows = table_rows(md, "| run | nodes | ranks | step s")
    by_label = {}
    for r in rows:
        by_label.setdefault(r[0], []).append(r)
    assert set(by_label) == {"nodes=1 algorithm=mcpo", "nodes=2 algorithm=mcpo", "nodes=1 algorithm=dapo", "nodes=2 algorithm=dapo"}
    one, two = by_label["nodes=1 algorithm=mcpo"][0], by_label["nodes=2 algorithm=mcpo"][0]
    # columns: run, nodes, ranks, step s, rollout s, train s, tokens/s/GPU, TFLOP/s/GPU, eff, peak
    assert one[1:4] == ["1", "2", "10.00"]        # warm-up step 1 (100 s) left out of the mean
    assert one[4:6] == ["4.00", "6.00"]
    assert two[1:4] == ["2", "4", "5.00"]
    assert one[6] == "100.0" and two[6] == "80.0"
    assert one[7] == "0.5" and two[7] == "0.4"
    assert one[8] == "1.00" and two[8] == "0.80"  # scaling efficiency vs the 1-node run of the same algorithm
    assert one[9] == "8.00" and two[9] == "4.00"  # peak over all steps: 2 * 4 / nodes
    assert "MFU" not in md.split("## Learning")[0]  # CPU-style runs: no MFU column

    # The algorithm axis: rows at fixed nodes, sorted by value; efficiency 1.0 (same ranks).
    alg_rows = table_rows(md, "| run | algorithm |")
    assert [r[1] for r in alg_rows] == ["dapo", "mcpo", "dapo", "mcpo"]
    assert [r[9] for r in alg_rows] == ["1.00"] * 4

    learn = {r[0]: r for r in table_rows(md, "| run | steps | accuracy")}
    assert learn["nodes=1 algorithm=mcpo"][1] == "4"
    assert learn["nodes=1 algorithm=mcpo"][2] == "0.700" and learn["nodes=1 algorithm=dapo"][2] == "0.600"

    # Final evaluation in Table 1 layout: only the runs that have eval results, pass@1/pass@8 cells.
    evals = {r[0]: r[1:] for r in table_rows(md, "| | AIME24 | AMC23 |")}
    assert set(evals) == {"nodes=2 algorithm=mcpo", "nodes=2 algorithm=dapo"}
    assert evals["nodes=2 algorithm=mcpo"] == [".2500/.4900", ".6000/.8900"]  # bootstrap pass@8 by default

    for name in ("reward_acc.png", "mastery.png", "retention.png", "entropy.png", "throughput_vs_nodes.png",
                 "time_split.png"):
        png = out / name
        assert png.is_file() and png.stat().st_size > 5000, name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({name})" in md


def test_report_from_metrics_evals_and_single_run(tmp_path):
    d = tmp_path / "only"
    d.mkdir()
    recs = _records(1, "mcpo", steps=2)
    recs[-1].update({"eval/champ/pass@1": 0.125, "eval/champ/pass@8": 0.5})
    for r in recs:  # a run without the accounting metrics: tokens/s falls back to the trainer's total
        del r["perf/tokens_per_s_per_gpu"]
        r["perf/generated_tokens_per_step_s"] = 300.0
        r["perf/generated_tokens_per_s"] = 900.0  # the rate over generation time only: not a step throughput
        r["time/last_checkpoint"] = 2.0  # a phase the report does not know: shown after the known ones
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    out = tmp_path / "rep"
    assert mcpo_main(["report", str(d), "--out", str(out), "--warmup-steps", "0"]) == 0
    md = (out / "report.md").read_text()
    assert "none (labelled by directory)" in md
    assert "| train s | last_checkpoint s | tokens/s/GPU |" in md
    row = table_rows(md, "| run | nodes | ranks | step s")[0]
    assert row[0] == "only" and row[3] == "55.00"  # mean of 100 and 10 with no warm-up skipped
    assert row[6] == "2.00"
    assert row[7] == "300.0*"                        # world size unknown: total / 1, flagged
    evals = table_rows(md, "| | CHAMP |")
    assert evals == [["only", ".1250/.5000"]]
    assert not (out / "throughput_vs_nodes.png").exists()  # one node count: nothing to plot
    assert "Not drawn" in md and "Throughput vs nodes" in md


def test_report_errors(tmp_path, capsys):
    assert mcpo_main(["report", str(tmp_path), "--out", str(tmp_path / "o")]) == 1
    assert "no metrics.jsonl" in capsys.readouterr().err
    assert mcpo_main(["report", "--help"]) == 0


def test_preset_runs_are_labelled_by_algorithm(tmp_path):
    """Runs of different presets differ in many algorithm keys; the report shows one `algorithm` axis with the
    preset and the preset keys a run overrides, not a sweep axis per key."""
    from mcpo_megatron.config import load_config, to_dict

    runs = []
    for name, overrides in (("mcpo", []), ("dapo", ["algorithm.filter_groups.enable=false"]), ("grpo", [])):
        d = tmp_path / name
        d.mkdir()
        cfg = to_dict(load_config(None, [f"algorithm.name={name}", f"trainer.output_dir={d}", *overrides]))
        (d / "config.yaml").write_text(yaml.safe_dump(cfg))
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _records(1, name)))
        runs.append(d)
    out = tmp_path / "report"
    assert mcpo_main(["report", *map(str, runs), "--out", str(out)]) == 0
    md = (out / "report.md").read_text()
    assert "Runs are labelled by the config keys that differ between them: `algorithm`." in md
    labels = [r[0] for r in table_rows(md, "| run | directory | steps |")]
    assert labels == ["algorithm=mcpo", "algorithm=dapo (filter_groups.enable=False)", "algorithm=grpo"]


def test_curve_legend_covers_no_panel(tmp_path, monkeypatch):
    """Long run labels (a sweep over several keys) go in a legend under the panels, not over the curves."""
    import matplotlib.figure
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.transforms import Bbox

    from mcpo_megatron.report import plots
    from mcpo_megatron.report.groups import RunGroup
    from mcpo_megatron.report.runs import Run

    label = "algorithm=dapo (filter_groups.enable=False) ppo_epochs=2 train=arith:ops=+,digits=1|2/1|2 lr=2e-05"
    groups = [RunGroup(label=f"{label} #{i}", runs=[Run(path=tmp_path, config={}, summary={"steps": 4},
                                                        records=_records(1, "dapo"))]) for i in range(8)]
    figures = []
    real_savefig = matplotlib.figure.Figure.savefig

    def keep(fig, *args, **kwargs):
        figures.append(fig)
        return real_savefig(fig, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", keep)
    out = plots.curves(groups, [("acc/mean", "accuracy"), ("retention/acc", "retention")], tmp_path / "c.png",
                       title="t")
    assert out is not None and out.stat().st_size > 0
    fig = figures[0]
    canvas = FigureCanvasAgg(fig)  # the figure was closed after saving: draw it again to measure it
    canvas.draw()
    renderer = canvas.get_renderer()
    legends = fig.legends or [ax.get_legend() for ax in fig.axes if ax.get_legend()]
    assert len(legends) == 1 and len(legends[0].get_texts()) == 8
    box = legends[0].get_window_extent(renderer)
    for ax in fig.axes:
        assert not Bbox.intersection(box, ax.get_window_extent(renderer)), "the legend covers a panel"


def test_report_options_refuse_bad_values_naming_them():
    from mcpo_megatron.report.build import ReportOptions

    with pytest.raises(ValueError, match=r"last_steps=0: must be >= 1"):
        ReportOptions(last_steps=0)
    with pytest.raises(ValueError, match=r"confidence=1.0: must be strictly between 0 and 1"):
        ReportOptions(confidence=1.0)
