"""Training on episodes with the Python tool, end to end: the CPU tool demo (configs/cpu_tool_arith.yaml, the
scripted tool model, MCPO) with the PyTorch engine for 8 steps and a periodic pass@k eval with tools, and with
vLLM's CPU build for 2 steps on 2 ranks (training TP=2, one rollout TP=2 engine); with partial rollouts (episodes
carried over mid-turn and mid-call from step to step), uninterrupted and preempted in the middle of a batch. One
run per setting serves every assertion."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mcpo_megatron.trainer.checkpoint import list_complete
from mcpo_megatron.trainer.metrics import is_measurement_key, read_jsonl

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


# ---------------------------------------------------------------------- partial rollouts with episodes
RECORDER = Path(__file__).parent / "workers" / "record_trained.py"
# Groups of 2, 6 trained a step out of 12 sent, one token a segment, a batch at least 2 decoding steps (16 / 8): a
# batch ends as soon as 6 groups are complete, and the others carry over mid-turn or mid-call. A checkpoint a step;
# packed sequences (the model mask travels with each episode into its bin).
PARTIAL = ["rollout.partial.enable=true", "rollout.partial.segment_tokens=1", "rollout.partial.spare_groups=6",
           "trainer.max_staleness=7", "trainer.total_steps=4", "rollout.n=2", "data.train_batch_size=6",
           "algorithm.mini_batch_size=2", "data.num_train_samples=64", "checkpoint.interval=1",
           "checkpoint.keep_last=4", "trainer.sequence_packing=true"]


def _recorded_run(root: Path, name: str, **env) -> tuple[subprocess.CompletedProcess, Path]:
    """The demo with partial rollouts through the recording worker (``workers/record_trained.py``: each step's
    uids and token versions), 1 process, on a scripted model that also checks its output with a second call."""
    trained = root / f"{name}.trained.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", MCPO_TEST_TRAINED=str(trained), **env)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", str(RECORDER),
           CONFIG, f"model.path={root / 'model'}", f"trainer.output_dir={root / name}", *PARTIAL]
    with open(root / f"{name}.log", "a") as f:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=600)
    return proc, trained


def _read(root: Path, name: str, trained: Path):
    return read_jsonl(root / name / "metrics.jsonl"), [json.loads(x) for x in trained.read_text().splitlines()]


def _pool(out: Path, step: int) -> list[dict]:
    """The unfinished records of the pool checkpointed at ``step``."""
    import torch

    state = torch.load(out / "checkpoints" / f"step_{step:06d}" / "trainer_state.pt", weights_only=True)
    return [m for g in state["rollout_pool"]["groups"] for m in g["members"] if m["finish_reason"] is None]


@pytest.fixture(scope="module")
def partial_root(tmp_path_factory):
    from mcpo_megatron.models.tool_model import make_tool_model

    root = tmp_path_factory.mktemp("tools_partial")
    make_tool_model(root / "model", p_call=0.3, p_guess_right=0.2, p_quit=0.0, p_again=0.6)
    return root


@pytest.fixture(scope="module")
def partial_run(partial_root):
    proc, trained = _recorded_run(partial_root, "whole")
    assert proc.returncode == 0, (partial_root / "whole.log").read_text()[-6000:]
    return _read(partial_root, "whole", trained)


def test_partial_rollouts_carry_episodes_over(partial_root, partial_run):
    """Episodes carried over from step to step, mid-turn and mid-call: an episode started in one step goes on in a
    later one with tokens of two versions; each step trains 6 whole groups of prompts not trained before; on the
    first step (one version) the trainer's log-probs of the model's tokens, packed, are the engine's."""
    records, trained = partial_run
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    seen = [u for t in trained for u in t["uids"]]
    assert all(len(t["uids"]) == 6 for t in trained) and len(seen) == len(set(seen))
    for step, t in enumerate(trained):
        for versions, length in zip(t["token_versions"], t["lengths"]):
            assert len(versions) == length and step - min(versions) <= 7 and max(versions) <= step
    assert any(len(set(v)) == 2 for t in trained for v in t["token_versions"])
    assert sum(r["partial/carried_unfinished"] for r in records) > 0
    assert all(r["tools/errors"] == 0 for r in records) and sum(r["tools/calls"] for r in records) > 0
    # second calls (the model checks its output), and tool tokens, which are not the model's
    assert sum(r["tools/calls_mean"] for r in records) > sum(r["tools/episodes_with_call"] for r in records)
    assert any(r.get("response/model_length_mean", np.inf) < r["response/length_mean"] for r in records)
    assert records[0]["mismatch/k3"] < 1e-8 and records[0]["mismatch/max_abs_logp_diff"] < 1e-4
    pending = [s for s in (1, 2, 3) if any(m["episode"]["pending_code"] for m in _pool(partial_root / "whole", s))]
    assert pending, "no checkpoint held an episode mid-call"


def test_partial_rollouts_with_episodes_resume_exactly_mid_call(partial_root, partial_run):
    """Preempted (SIGUSR1) as the engine starts the first segment of the step after one whose checkpoint holds an
    episode between its code block and the call (the code kept, not run): that step is checkpointed again, and
    the resumed run is the uninterrupted one, metric for metric and sample for sample."""
    step = next(s for s in (1, 2, 3) if any(m["episode"]["pending_code"] for m in _pool(partial_root / "whole", s)))
    out = partial_root / "pre"
    proc, trained = _recorded_run(partial_root, "pre", MCPO_TEST_SIGNAL_STEP=str(step + 1),
                                  MCPO_TEST_SIGNAL_SEGMENT="1")
    log = (partial_root / "pre.log").read_text()
    assert proc.returncode == 0 and f"received during generation: checkpointed step {step}" in log, log[-4000:]
    assert [s for s, _ in list_complete(out / "checkpoints")][-1] == step
    assert any(m["episode"]["pending_code"] for m in _pool(out, step))
    proc, trained = _recorded_run(partial_root, "pre")
    assert proc.returncode == 0, (partial_root / "pre.log").read_text()[-6000:]
    resumed, again = _read(partial_root, "pre", trained)
    records, want = partial_run

    def comparable(rs):
        return [{k: v for k, v in r.items() if not is_measurement_key(k) and k != "tools/seconds"} for r in rs]
    assert comparable(resumed) == comparable(records)
    assert again == want


# ---------------------------------------------------------------------- routing replay (r3) on episodes
@pytest.fixture(scope="module")
def moe_runs(tmp_path_factory):
    """The demo on a mixture-of-experts tool model (Qwen3-MoE, 4 experts, top-2; its routers see each position's
    token) with r3: whole episodes for 2 steps, and partial rollouts (the episodes carried over) for 3."""
    from mcpo_megatron.models.tool_model import make_tool_model

    root = tmp_path_factory.mktemp("tools_moe")
    make_tool_model(root / "model", family="qwen3_moe", p_call=0.5, p_guess_right=0.2, p_quit=0.0, p_again=0.5)
    common = [f"model.path={root / 'model'}", "model.moe_routing_replay=r3", "optimizer.lr=1e-9"]
    whole = _train(root / "whole", *common, "trainer.total_steps=2")
    partial = _train(root / "partial", *common, *[o for o in PARTIAL if not o.startswith(("trainer.total_steps",
                                                                                          "checkpoint.",
                                                                                          "trainer.sequence_packing"))],
                     "trainer.total_steps=3")
    return whole, partial


def test_routing_replay_follows_the_episodes(moe_runs):
    """Every position the engine ran in an episode (the prompt, the model's tokens, and the tool's tokens, which the
    next turn runs as its prompt) is replayed with the experts the engine chose there: the trainer's routers agree
    with the replayed choices everywhere (a routing shifted by one position would disagree at about every
    position), and the log-probs of the model's tokens match the engine's."""
    whole, partial = moe_runs
    assert [r["step"] for r in whole] == [1, 2] and [r["step"] for r in partial] == [1, 2, 3]
    assert sum(r["tools/calls"] for r in whole + partial) > 4
    assert sum(r["partial/carried_unfinished"] for r in partial) > 0
    for r in whole + partial:
        assert r["moe/routing_mismatch_frac"] == 0 and r["mismatch/max_abs_logp_diff"] < 1e-4, r


# ---------------------------------------------------------------------- the chat template's tool calls
def test_training_with_the_chat_templates_tool_calls(tmp_path):
    """tools.format=chat_template end to end: the prompts declare the tool through the chat template, the scripted
    model's <tool_call>s run, their outputs come back as the template's tool messages, and the trainer and the
    engine agree on the model's tokens; the retention probe's rollouts of mastered prompts are episodes too (the
    scripted model is right through the tool)."""
    from mcpo_megatron.models.tool_model import make_tool_model

    make_tool_model(tmp_path / "model", syntax="chat_template", p_call=0.5, p_guess_right=0.2, p_quit=0.0)
    records = _train(tmp_path / "out", f"model.path={tmp_path / 'model'}", "tools.format=chat_template",
                     "data.apply_chat_template=true", "data.max_prompt_length=32", "trainer.total_steps=5",
                     "diagnostics.retention_probe=true")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    for r in records:
        assert 0 < r["tools/episodes_with_call"] < 1 and r["tools/errors"] == 0
        assert r["response/model_length_mean"] < r["response/length_mean"]
        assert r["mismatch/k3"] < 1e-8 and r["mismatch/max_abs_logp_diff"] < 1e-4
    assert records[-1]["acc/mean"] > 0.4  # the tool's answers are right
    probed = [r for r in records if r.get("retention/probe_samples", 0) > 0]
    assert probed and all(r["retention/probe_acc"] > 0 for r in probed)
