"""The sweep's seed axis on a real run pair: two one-step training runs that differ only in the seed (the axis
sets trainer.seed and rollout.seed) must sample differently. How `mcpo report` groups seeds and computes their
intervals is tested on synthetic runs (test_seeds.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mcpo_megatron.models.tiny import make_tiny_model_with_tokenizer  # noqa: E402

from launch import sweep  # noqa: E402
from mcpo_megatron.trainer.metrics import read_jsonl  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TRAIN = "arith:ops=+,digits=1"
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
        "optimizer.lr=1e-3", "trainer.total_steps=1", "trainer.max_tokens_per_microbatch=256",
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
    assert len(a) == len(b) == 1
    assert [r["actor/entropy"] for r in a] != [r["actor/entropy"] for r in b]

