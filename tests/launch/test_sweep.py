"""launch.sweep without a cluster: axes parsing, labels, dry run, per-point configs, argument errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from launch import sweep

REPO = Path(__file__).resolve().parents[2]
CPU_CONFIG = str(REPO / "configs" / "cpu_smollm2_arith.yaml")


def test_parse_axes_and_points():
    nodes, axes = sweep.parse_axes("1,2", ["algorithm.name=mcpo,dapo", "rollout.n=4"])
    assert nodes == [1, 2]
    assert axes == [("algorithm.name", ["mcpo", "dapo"]), ("rollout.n", ["4"])]
    points = sweep.make_points(nodes, axes)
    assert [p["label"] for p in points] == ["nodes-1_name-mcpo", "nodes-1_name-dapo", "nodes-2_name-mcpo",
                                            "nodes-2_name-dapo"]
    assert points[3]["nodes"] == 2 and points[3]["overrides"] == ["algorithm.name=dapo", "rollout.n=4"]
    # Clashing last components keep the full key; a single point is labelled "run".
    clash = sweep.make_points([1], [("a.lr", ["1", "2"]), ("b.lr", ["3", "4"])])
    assert clash[0]["label"] == "a.lr-1_b.lr-3" and len(clash) == 4
    assert sweep.make_points([1], [])[0]["label"] == "run"


@pytest.mark.parametrize("nodes,sets,match", [
    ("1,x", [], "--nodes='1,x'"),
    ("0,1", [], "must be >= 1"),
    ("1,1", [], "repeated"),
    ("1", ["algorithm.name"], "write KEY=V1,V2"),
    ("1", ["a=1,,2"], "non-empty"),
    ("1", ["a=1", "a=2"], "given twice"),
])
def test_parse_axes_errors(nodes, sets, match):
    with pytest.raises(ValueError, match=match):
        sweep.parse_axes(nodes, sets)


def test_dry_run_prints_points(capsys, tmp_path):
    rc = sweep.main(["--config", CPU_CONFIG, "--nodes", "1,2", "--set", "algorithm.name=mcpo,dapo", "--executor",
                     "slurm", "--gpus-per-node", "2", "--sweep-dir", str(tmp_path), "trainer.total_steps=2",
                     "--dry-run"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "4 point(s)" in out
    assert f"nodes-2_name-dapo: nodes=2 algorithm.name=dapo trainer.total_steps=2 -> {tmp_path}/nodes-2_name-dapo" \
        in out
    assert not any(tmp_path.iterdir())  # a dry run writes nothing


def test_prepare_points_writes_resolved_configs(tmp_path):
    points = sweep.make_points([1, 2], [("algorithm.name", ["mcpo", "dapo"])])
    problems = sweep.prepare_points(points, CPU_CONFIG, ["trainer.total_steps=3"], tmp_path, gpus_per_node=2)
    assert problems == []
    d = tmp_path / "nodes-2_name-dapo"
    cfg = yaml.safe_load((d / "config.yaml").read_text())
    assert cfg["algorithm"]["name"] == "dapo"
    # the name is a preset: the two arms really differ (they used to be two identical MCPO runs)
    mcpo = yaml.safe_load((tmp_path / "nodes-2_name-mcpo" / "config.yaml").read_text())["algorithm"]
    assert (cfg["algorithm"]["mcpo"]["hinge_kl"]["enable"], cfg["algorithm"]["mcpo"]["reweight"]) == (False, False)
    assert (mcpo["mcpo"]["hinge_kl"]["enable"], mcpo["mcpo"]["reweight"]) == (True, True)
    assert (cfg["algorithm"]["filter_groups"]["enable"], mcpo["filter_groups"]["enable"]) == (True, False)
    assert cfg["trainer"]["total_steps"] == 3
    assert cfg["trainer"]["output_dir"] == str(d)
    point = json.loads((d / sweep.SWEEP_POINT_FILE).read_text())
    assert point["nodes"] == 2 and point["world_size"] == 4 and point["overrides"] == ["algorithm.name=dapo"]
    listing = json.loads((tmp_path / "sweep.json").read_text())
    assert [p["label"] for p in listing["points"]] == [p["label"] for p in points]
    # the report reads the same file name
    from mcpo_megatron.report.runs import SWEEP_POINT_FILE

    assert SWEEP_POINT_FILE == sweep.SWEEP_POINT_FILE


def test_invalid_point_is_refused_before_submission(tmp_path, capsys):
    # PP=2 in the CPU config: a world size of 3 (3 nodes x 1 rank) cannot hold it.
    rc = sweep.main(["--config", CPU_CONFIG, "--nodes", "1,3", "--executor", "slurm", "--gpus-per-node", "1",
                     "--sweep-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2
    assert "point nodes-3 (world size 3)" in err
    assert not (tmp_path / "sweep.json").exists()


def test_bad_arguments(capsys, tmp_path):
    assert sweep.main(["--config", CPU_CONFIG, "--nodes", "1,2", "--executor", "local", "--dry-run"]) == 2
    assert "local executor runs on this machine only" in capsys.readouterr().err
    assert sweep.main(["--config", "configs/nope.yaml", "--dry-run"]) == 2
    assert "no such file" in capsys.readouterr().err
    assert sweep.main(["--config", CPU_CONFIG, "--set", "x", "--dry-run"]) == 2


@pytest.mark.parametrize("text,seconds", [("30", 1800), ("05:30", 330), ("04:00:00", 14400), ("1-02:00:00", 93600),
                                          ("2-03", 183600)])
def test_slurm_seconds(text, seconds):
    assert sweep.slurm_seconds(text) == seconds


def test_sweep_seed_axis_points(tmp_path):
    _, axes = sweep.parse_axes("1", ["seed=1,2", "algorithm.name=mcpo,dapo"])
    points = sweep.make_points([1], axes)
    assert [p["label"] for p in points] == ["seed-1_name-mcpo", "seed-1_name-dapo", "seed-2_name-mcpo",
                                            "seed-2_name-dapo"]
    assert points[3]["overrides"] == ["trainer.seed=2", "rollout.seed=2", "algorithm.name=dapo"]
    assert points[3]["seed"] == 2
    with_data = sweep.make_points([1], axes, ["trainer.seed", "rollout.seed", "data.seed"])
    assert with_data[0]["overrides"][:3] == ["trainer.seed=1", "rollout.seed=1", "data.seed=1"]
    assert sweep.make_points([1], [("algorithm.name", ["mcpo"])])[0]["seed"] is None


@pytest.mark.parametrize("sets,match", [
    (["seed=1,x"], "seeds must be integers"),
    (["seed=1,2", "trainer.seed=3,4"], "already sets the seed keys"),
])
def test_seed_axis_errors(sets, match):
    with pytest.raises(ValueError, match=match):
        sweep.parse_axes("1", sets)


def test_seed_keys_option(capsys, tmp_path):
    assert sweep.parse_seed_keys("trainer.seed,data.seed") == ["trainer.seed", "data.seed"]
    with pytest.raises(ValueError, match="optimizer.lr is not a seed key"):
        sweep.parse_seed_keys("trainer.seed,optimizer.lr")
    rc = sweep.main(["--config", CPU_CONFIG, "--set", "seed=3,4", "--executor", "slurm", "--gpus-per-node", "2",
                     "--seed-keys", "rollout.seed", "--sweep-dir", str(tmp_path), "--dry-run"])
    out = capsys.readouterr().out
    assert rc == 0 and "seed-4: nodes=1 rollout.seed=4 -> " in out and "trainer.seed" not in out
