"""End to end on CPU/gloo with the paths the resume test does not take: DAPO dynamic sampling with
over-sampling, GCPO reference injection, the retention probe and periodic evaluation, in one short run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mcpo_megatron.models.tiny import make_tiny_model_with_tokenizer  # noqa: E402

from mcpo_megatron.data import load_prompts  # noqa: E402
from mcpo_megatron.trainer.metrics import read_jsonl  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TRAIN = "arith:ops=-,digits=1"
pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("variants")
    model = make_tiny_model_with_tokenizer(root / "model")
    records, _ = load_prompts(TRAIN, num_samples=32, seed=0, template="number")
    refs = root / "references.jsonl"
    refs.write_text("".join(json.dumps({"uid": r.uid, "response": r.ground_truth}) + "\n" for r in records))
    overrides = [
        f"model.path={model}", "model.dtype=fp32", "parallelism.tensor_model_parallel_size=2",
        "rollout.n=4", "rollout.max_new_tokens=1", "rollout.generation_batch_size=32",
        f"data.train={TRAIN}", "data.train_batch_size=4", "data.max_prompt_length=64",
        "data.max_response_length=2", "data.prompt_template=number", "data.num_train_samples=32",
        "algorithm.name=gcpo", "algorithm.mini_batch_size=2", "algorithm.filter_groups.enable=true",
        "algorithm.filter_groups.max_gen_batches=3", "algorithm.gcpo.enable=true",
        f"algorithm.gcpo.references={refs}",
        "reward.answer_format=last_number", "reward.num_workers=1", "reward.timeout_s=5",
        "reward.overlong_buffer.enable=false", "optimizer.lr=1e-3", "optimizer.weight_decay=0.0",
        "trainer.total_steps=3", f"trainer.output_dir={root / 'out'}", "trainer.max_tokens_per_microbatch=256",
        "checkpoint.interval=0", "logging.tensorboard=false",
        "diagnostics.retention_probe=true", "diagnostics.retention_probe_n=2",
        "eval.interval=3", f"eval.benchmarks=['{TRAIN}']", "eval.k=2", "eval.max_new_tokens=1",
        "eval.num_problems=5",
    ]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "mcpo_megatron.cli", "train", *overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return root / "out"


@pytest.fixture(scope="module")
def run(run_dir):
    return read_jsonl(run_dir / "metrics.jsonl")


def test_gcpo_fills_every_all_wrong_group(run):
    for r in run:
        # Every all-wrong group got a reference, so no group is all-wrong after injection ...
        assert r["mastery/all_wrong_frac"] == 0.0
        assert r["gcpo/injected"] >= 0
    # ... and the mostly-wrong tiny model needs references on some step.
    assert sum(r["gcpo/injected"] for r in run) > 0


def test_dynamic_sampling_keeps_only_mixed_groups(run):
    for r in run:
        assert r["batch/gen_batches"] >= 1
        assert r["batch/groups"] <= 4
        # Kept groups are neither all-correct nor all-wrong.
        assert r["mastery/mastered_frac"] == 0.0 and 0.0 < r["acc/mean"] < 1.0


def test_evaluation_and_retention_are_logged(run):
    last = run[-1]
    assert 0.0 <= last[f"eval/{TRAIN}/pass@1"] <= 1.0
    assert "retention/acc" in last


def test_generation_rate_is_over_generation_time(run):
    """With eval (step 3) and training in the step, tokens/s of generation and of the whole step differ; both
    count the same generated tokens (the response lengths of every generated sequence)."""
    for r in run:
        tokens_gen = r["perf/generated_tokens_per_s"] * r["time/rollout"]
        tokens_step = r["perf/generated_tokens_per_step_s"] * r["time/step"]
        # a count recovered from a rate and a time: an integer up to rounding
        assert tokens_gen == pytest.approx(tokens_step, rel=1e-6) and tokens_gen == pytest.approx(round(tokens_gen))
        assert round(tokens_gen) >= r["batch/sequences"]
    assert run[-1]["time/eval"] > 0 and run[-1]["perf/generated_tokens_per_s"] > run[-1]["perf/generated_tokens_per_step_s"]


def test_evaluation_writes_per_problem_results(run, run_dir):
    """The periodic evaluation keeps what the flat metrics cannot: per-problem counts (for the report's bootstrap
    intervals over problems), on eval.num_problems problems."""
    from mcpo_megatron.evaluation import read_results

    results = read_results(run_dir / "eval" / "eval_results.json")
    assert list(results) == ["step_3"]
    res = results["step_3"][TRAIN]
    assert res.num_problems == 5 and len(res.per_problem) == 5 and res.k == 2
    assert sum(p["correct"] for p in res.per_problem) / 10 == pytest.approx(res.pass_at_1)
    assert run[-1][f"eval/{TRAIN}/pass@1"] == pytest.approx(res.pass_at_1)
    assert run[-1][f"eval/{TRAIN}/num_problems"] == 5
