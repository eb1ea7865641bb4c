"""Seed aggregation on a real run pair: two tiny training runs that differ only in the seed (set through the
sweep's seed axis, so trainer.seed and rollout.seed both change), then `mcpo report`. The runs must differ
(the seed reaches the sampler) and the report's group row must be the mean ± Student-t interval of the two
runs' own logged values, recomputed here from metrics.jsonl."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_tokenizer import make_tiny_model_with_tokenizer  # noqa: E402

from launch import sweep  # noqa: E402
from md_tables import table_rows  # noqa: E402
from mcpo_megatron.cli import main as mcpo_main  # noqa: E402
from mcpo_megatron.trainer.metrics import read_jsonl  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TRAIN = "arith:ops=+,digits=1"
T975_DF1 = math.tan(math.pi * 0.475)  # Student-t 0.975 quantile, 1 degree of freedom (closed form)
pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def run_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("seed_runs")
    model = make_tiny_model_with_tokenizer(root / "model")
    _, axes = sweep.parse_axes("1", ["seed=1,2"])
    points = sweep.make_points([1], axes)
    common = [
        f"model.path={model}", "model.dtype=fp32", "parallelism.tensor_model_parallel_size=1",
        "rollout.engine=torch", "rollout.n=4", "rollout.max_new_tokens=2", "rollout.generation_batch_size=32",
        f"data.train={TRAIN}", "data.train_batch_size=4", "data.max_prompt_length=64",
        "data.max_response_length=2", "data.prompt_template=number", "data.num_train_samples=16",
        "algorithm.name=mcpo", "algorithm.mini_batch_size=2", "reward.answer_format=last_number",
        "reward.num_workers=1", "reward.timeout_s=5", "reward.overlong_buffer.enable=false",
        "optimizer.lr=1e-3", "trainer.total_steps=3", "trainer.max_tokens_per_microbatch=256",
        "checkpoint.interval=0", "logging.tensorboard=false",
    ]
    config = str(REPO / "configs" / "cpu_smollm2_arith.yaml")
    assert sweep.prepare_points(points, config, common, root / "sweep", gpus_per_node=1) == []
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    for p in points:
        run_dir = Path(p["run_dir"])
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
               "-m", "mcpo_megatron.cli", "train", str(run_dir / "config.yaml")]
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return root / "sweep"


def test_the_seed_reaches_the_sampler(run_pair):
    a, b = (read_jsonl(run_pair / f"seed-{s}" / "metrics.jsonl") for s in (1, 2))
    assert len(a) == len(b) == 3
    assert [r["actor/entropy"] for r in a] != [r["actor/entropy"] for r in b]


def test_report_group_is_the_mean_and_interval_of_the_pair(run_pair, tmp_path):
    out = tmp_path / "report"
    assert mcpo_main(["report", str(run_pair), "--out", str(out), "--last-steps", "2"]) == 0
    md = (out / "report.md").read_text()
    assert "grouped as replicates: 1 group(s)" in md
    header = "| run | seeds | steps | accuracy | reward | mastered | all-wrong | entropy | resp. length |"
    [row] = table_rows(md, header)  # one group of 2 seeds
    cells = dict(zip([c.strip() for c in header.strip("|").split("|")], row))
    assert (cells["run"], cells["seeds"], cells["steps"]) == ("all runs", "2", "3")

    def pm(key: str) -> str:
        vals = [sum(r[key] for r in read_jsonl(run_pair / f"seed-{s}" / "metrics.jsonl")[-2:]) / 2
                for s in (1, 2)]
        mean = sum(vals) / 2
        half = T975_DF1 * abs(vals[0] - vals[1]) / math.sqrt(2) / math.sqrt(2)
        return f"{mean:.3f} ± {half:.3f}"

    assert cells["accuracy"] == pm("acc/mean")
    assert cells["entropy"] == pm("actor/entropy")
    assert cells["resp. length"] == pm("response/length_mean")
    assert pm("actor/entropy").split(" ± ")[1] != "0.000"  # the interval reflects a real seed-to-seed spread
