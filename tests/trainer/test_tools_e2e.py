"""Training on episodes with the Python tool, end to end: the CPU tool demo (configs/cpu_tool_arith.yaml, the
scripted tool model, MCPO) with the PyTorch engine for 8 steps and a periodic pass@k eval with tools, and with
vLLM's CPU build for 2 steps on 2 ranks (training TP=2, one rollout TP=2 engine). One run per engine serves every
assertion."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mcpo_megatron.trainer.metrics import read_jsonl

REPO = Path(__file__).resolve().parents[2]
CONFIG = "configs/cpu_tool_arith.yaml"
BENCH = "arith:ops=*"
pytestmark = pytest.mark.multiproc


def _train(out: Path, *overrides: str, ranks: int = 1) -> list[dict]:
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"] if ranks > 1 else []
    cmd = [sys.executable, *launcher, "-m", "mcpo_megatron.cli", "train", CONFIG, f"trainer.output_dir={out}",
           *overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return read_jsonl(out / "metrics.jsonl")


@pytest.fixture(scope="module")
def torch_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("tools_torch") / "out"
    return out, _train(out, "trainer.total_steps=8", "eval.interval=8", f"eval.benchmarks=['{BENCH}']",
                       "eval.k=2", "eval.num_problems=6", "eval.max_new_tokens=16")


@pytest.fixture(scope="module")
def vllm_run(tmp_path_factory):
    """One vLLM engine over 2 ranks (the external launcher, rollout TP=2): its first rank runs the calls and
    hands the results to the other (``VLLMRolloutEngine.share_within_engine``; the other rank has no sandbox)."""
    return _train(tmp_path_factory.mktemp("tools_vllm") / "out", "rollout.engine=vllm", "trainer.total_steps=2",
                  "rollout.tensor_parallel_size=2", "parallelism.tensor_model_parallel_size=2", ranks=2)


@pytest.fixture(scope="module")
def separate_run(tmp_path_factory):
    """The engine on a rank of its own (rollout.placement=separate): the engine rank builds the sandbox."""
    return _train(tmp_path_factory.mktemp("tools_separate") / "out", "rollout.placement=separate", "rollout.ranks=1",
                  "trainer.total_steps=3", ranks=2)


def test_an_engine_rank_of_its_own_generates_the_same_episodes(torch_run, separate_run):
    """trainer.max_staleness=0: each step's batch comes from the step's weights, as colocated, so the first steps'
    records agree (their episodes are the same samples, sampled with the same seeds)."""
    _, colocated = torch_run
    assert [r["step"] for r in separate_run] == [1, 2, 3]
    for a, b in zip(separate_run, colocated[:3]):
        for key in ("acc/mean", "tools/episodes_with_call", "tools/calls", "response/length_mean",
                    "response/model_length_mean"):
            assert a[key] == pytest.approx(b[key], abs=1e-9), key


def test_the_metrics_line_counts_the_tool_use(torch_run):
    _, records = torch_run
    assert [r["step"] for r in records] == list(range(1, 9))
    for r in records:
        assert 0 < r["tools/episodes_with_call"] < 1 and r["tools/calls"] == pytest.approx(
            64 * r["tools/calls_mean"])
        # a turn after each call, unless the call's output used up the response budget
        assert r["tools/calls_mean"] < r["tools/turns_mean"] <= 1 + r["tools/calls_mean"]
        assert r["tools/seconds"] > 0 and r["tools/timeouts"] == 0
        # tool tokens are in the response, not among the model's tokens
        assert r["response/model_length_mean"] < r["response/length_mean"]


def test_the_policy_learns_to_call_the_tool(torch_run):
    """The tool path is the right one: MCPO raises its share and the accuracy (measured: calls 0.50 -> 0.77,
    accuracy 0.67 -> 0.92 over 8 steps; the thresholds leave room for the machine's rounding)."""
    _, records = torch_run
    first, last = records[0], records[-3:]
    assert sum(r["tools/episodes_with_call"] for r in last) / 3 > first["tools/episodes_with_call"] + 0.1
    assert sum(r["acc/mean"] for r in last) / 3 > first["acc/mean"] + 0.1


def test_the_engine_and_trainer_agree_on_the_models_tokens(torch_run, vllm_run):
    """Token in, token out: the trainer's recomputed log-probs of the model's tokens of every episode match the
    engine's (the tool's tokens are not compared: never sampled)."""
    _, records = torch_run
    for r in records + vllm_run:
        assert r["mismatch/k3"] < 1e-8 and r["mismatch/max_abs_logp_diff"] < 1e-4


def test_vllm_generates_the_episodes(vllm_run):
    assert [r["step"] for r in vllm_run] == [1, 2]
    for r in vllm_run:
        assert 0 < r["tools/episodes_with_call"] < 1 and r["tools/errors"] == 0
        assert r["response/model_length_mean"] < r["response/length_mean"]


def test_eval_runs_episodes_too(torch_run):
    out, records = torch_run
    from mcpo_megatron.evaluation import read_results

    res = read_results(out / "eval" / "eval_results.json")["step_8"][BENCH]
    assert res.num_problems == 6 and res.k == 2
    assert records[-1][f"eval/{BENCH}/pass@1"] == pytest.approx(res.pass_at_1) and res.pass_at_1 > 0.5
