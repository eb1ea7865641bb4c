"""End to end on CPU/gloo: the real trainer (Megatron policy at TP=2, CPU engine, math-verify pool) on a tiny
model. Against an uninterrupted run, two interrupted runs give exactly its metrics: one with the training state
offloaded to host memory while the engine generates (trainer.offload), killed after its step-2 checkpoint (leaving
a partial record in metrics.jsonl) and resumed, whose every metric also equals the resident run's; and one
preempted by a signal that reaches one rank during generation (checkpointed at once) and resumed, resident."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mcpo_megatron.models.tiny import make_tiny_model_with_tokenizer  # noqa: E402

from mcpo_megatron.trainer.checkpoint import find_latest, list_complete  # noqa: E402
from mcpo_megatron.trainer.metrics import is_measurement_key, read_jsonl  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
STARTUP_PHASES = ("imports", "process_groups", "tokenizer_and_prompts", "policy", "engine",
                  "weight_plan_and_reward_workers", "first_weight_update")
pytestmark = pytest.mark.multiproc


def _overrides(model_dir, out_dir, steps=4):
    return [
        f"model.path={model_dir}", "model.dtype=fp32",
        "parallelism.tensor_model_parallel_size=2",
        "rollout.n=8", "rollout.max_new_tokens=1", "rollout.generation_batch_size=16",
        "data.train=arith:ops=-,digits=1", "data.train_batch_size=4", "data.max_prompt_length=64",
        "data.max_response_length=1",
        "data.prompt_template=number", "data.num_train_samples=32",
        "algorithm.mini_batch_size=2",
        "reward.answer_format=last_number", "reward.num_workers=1", "reward.timeout_s=5",
        "reward.overlong_buffer.enable=false",
        "optimizer.lr=1e-3", "optimizer.weight_decay=0.0",
        f"trainer.total_steps={steps}", f"trainer.output_dir={out_dir}", "trainer.max_tokens_per_microbatch=256",
        "checkpoint.interval=2", "checkpoint.keep_last=2", "logging.tensorboard=false",
    ]


def _cmd(overrides):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            "-m", "mcpo_megatron.cli", "train", *overrides]


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _run(overrides, log):
    with open(log, "w") as f:
        proc = subprocess.run(_cmd(overrides), cwd=REPO, env=_env(), stdout=f, stderr=subprocess.STDOUT, timeout=600)
    assert proc.returncode == 0, Path(log).read_text()[-6000:]


def _comparable(records):
    return [{k: v for k, v in r.items() if not is_measurement_key(k)} for r in records]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    model = make_tiny_model_with_tokenizer(root / "model")
    # Uninterrupted: 4 steps.
    _run(_overrides(model, root / "full"), root / "full.log")
    # Killed and offloaded (trainer.offload forced on: it resolves off on CPU): every rank is SIGKILLed right after
    # the step-2 checkpoint, then the job is started again.
    cut = root / "cut"
    offload_on = [*_overrides(model, cut), "trainer.offload.enable=true"]
    crash = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
             str(Path(__file__).parent / "workers" / "crash_after_checkpoint.py"), *offload_on]
    with open(root / "cut1.log", "w") as f:
        proc = subprocess.run(crash, cwd=REPO, env=dict(_env(), MCPO_TEST_CRASH_STEP="2"), stdout=f,
                              stderr=subprocess.STDOUT, timeout=600)
    killed = proc.returncode != 0 and find_latest(cut / "checkpoints").name == "step_000002"
    with open(cut / "metrics.jsonl", "a") as f:  # and the node died while appending a record
        f.write('{"step": 3, "reward/me')
    _run(offload_on, root / "cut2.log")
    # Preempted: rank 0 alone is signalled as step 2's rollouts start (no checkpoint of step 1 exists yet).
    pre = root / "preempted"
    signalled = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                 str(Path(__file__).parent / "workers" / "signal_during_generation.py"), *_overrides(model, pre)]
    with open(root / "pre1.log", "w") as f:
        first = subprocess.run(signalled, cwd=REPO, env=dict(_env(), MCPO_TEST_SIGNAL_STEP="2"), stdout=f,
                               stderr=subprocess.STDOUT, timeout=600)
    preempted = {"rc": first.returncode, "marker": (pre / "PREEMPTED").read_text().strip()
                 if (pre / "PREEMPTED").is_file() else None,
                 "checkpoints": [s for s, _ in list_complete(pre / "checkpoints")],
                 "steps_logged": [r["step"] for r in read_jsonl(pre / "metrics.jsonl")]}
    _run(_overrides(model, pre), root / "pre2.log")
    return {"root": root, "model": model, "killed": killed, "preempted": preempted}


def test_uninterrupted_run_logs_every_step(runs):
    recs = read_jsonl(runs["root"] / "full" / "metrics.jsonl")
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    for r in recs:
        for key in ("reward/mean", "acc/mean", "mastery/mastered_frac", "actor/grad_norm", "hkl/active_frac",
                    "mismatch/k3", "time/rollout", "time/train", "reward/status_ok", "retention/acc"):
            assert key in r, key
        assert r["batch/sequences"] == 32
        assert r["reward/status_ok"] + r["reward/status_no_answer"] == 32
        # fp32 CPU engine vs Megatron policy on the same weights: the log-probs agree closely.
        assert r["mismatch/max_abs_logp_diff"] < 1e-3
    # The digits-favouring tiny model answers right now and then, so the policy really is updated.
    assert any(r["actor/grad_norm"] > 0 for r in recs)
    assert any(0 < r["acc/mean"] < 1 for r in recs)
    # The first step's record carries rank 0's start-up, phase by phase, as the log's start-up line printed it
    # (the line in the order the phases ran; the record's keys are sorted).
    phases = {k: v for k, v in recs[0].items() if k.startswith("time/startup/")}
    assert sorted(phases) == sorted(f"time/startup/{p}" for p in STARTUP_PHASES)
    assert all(v > 0 for v in phases.values()) and recs[0]["time/startup"] == pytest.approx(sum(phases.values()))
    assert not any(k.startswith("time/startup") for r in recs[1:] for k in r)
    line = next(x for x in (runs["root"] / "full.log").read_text().splitlines() if x.startswith("start-up "))
    assert line.startswith(f"start-up {recs[0]['time/startup']:.1f} s: ")
    assert [part.rsplit(" ", 1)[0] for part in line.split(": ", 1)[1].split(" | ")] == [
        p.replace("_", " ") for p in STARTUP_PHASES]


def test_resume_after_kill_reproduces_metrics(runs):
    assert runs["killed"], "the interrupted run finished before it could be killed"
    full = read_jsonl(runs["root"] / "full" / "metrics.jsonl")
    resumed = read_jsonl(runs["root"] / "cut" / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert _comparable(resumed) == _comparable(full)
    # the resumed process's first step (3) has the checkpoint's load among its start-up phases
    assert sorted(k for k in resumed[2] if k.startswith("time/startup/")) == sorted(
        f"time/startup/{p}" for p in (*STARTUP_PHASES, "resume"))
    log = (runs["root"] / "cut2.log").read_text()
    line = next(x for x in log.splitlines() if x.startswith("start-up "))
    assert "| weight plan and reward workers " in line and "| resume " in line
    assert line.index("| resume ") < line.index("| first weight update ")
    assert "resumed from" in log and "step_000002" in log
    assert f"{runs['root'] / 'cut' / 'metrics.jsonl'}: line 3 is a partial record" in log


def test_signal_during_generation_checkpoints_at_once_and_resumes_exactly(runs):
    """SIGUSR1 on one rank while step 2 generates: every rank stops generating, step 1 is checkpointed at once (its
    weights are still the policy's), the run exits 0 for requeue; the resumed run repeats step 2 exactly."""
    pre = runs["preempted"]
    log = (runs["root"] / "pre1.log").read_text()
    assert pre["rc"] == 0, log[-4000:]
    assert pre["marker"] == "1" and pre["checkpoints"] == [1] and pre["steps_logged"] == [1], pre
    assert "received during generation: checkpointed step 1" in log
    full = read_jsonl(runs["root"] / "full" / "metrics.jsonl")
    resumed = read_jsonl(runs["root"] / "preempted" / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert _comparable(resumed) == _comparable(full)


def test_checkpoints_complete_and_pruned(runs):
    steps = [s for s, _ in list_complete(runs["root"] / "full" / "checkpoints")]
    assert steps == [2, 4]
    latest = find_latest(runs["root"] / "full" / "checkpoints")
    assert latest.name == "step_000004"
    meta = json.loads((latest / "COMPLETE").read_text())
    assert meta["step"] == 4


def test_offloaded_run_equals_resident_run_bit_for_bit_across_resume(runs):
    """trainer.offload: the policy's weights, gradient buffers, fp32 optimizer state leave the device after each
    weight update and come back before the old log-probs, checkpoints bring them back for the save; every
    metric of every step equals the run that keeps them resident, across a kill and a resume."""
    assert runs["killed"], "the offloaded run finished before it could be killed"
    full = read_jsonl(runs["root"] / "full" / "metrics.jsonl")
    offloaded = read_jsonl(runs["root"] / "cut" / "metrics.jsonl")
    assert [r["step"] for r in offloaded] == [1, 2, 3, 4]
    assert _comparable(offloaded) == _comparable(full)
    for r in offloaded:  # what moved, measured: the weights and Adam state copied, the gradients released
        assert r["memory/offload_copied_gb"] > 0 and r["memory/offload_released_gb"] > 0
        assert r["time/onload"] > 0
    assert "memory/offload_copied_gb" not in full[0]
