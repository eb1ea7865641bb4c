"""End to end on CPU/gloo (tiny model, 2 processes, TP=2): the reference-KL term of GRPO's recipe
(algorithm.kl.enable) with a frozen reference policy. At step 1 the policy IS the reference, so their log-probs
agree bit for bit; after the first update the KL term acts; a resumed run keeps the initial weights as its
reference (the metrics equal an uninterrupted run's)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_resume_e2e import REPO, _cmd, _comparable, _env, _overrides  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mcpo_megatron.models.tiny import make_tiny_model_with_tokenizer  # noqa: E402

import subprocess  # noqa: E402

from mcpo_megatron.trainer.checkpoint import find_latest  # noqa: E402
from mcpo_megatron.trainer.metrics import read_jsonl  # noqa: E402

pytestmark = pytest.mark.multiproc
# A learning rate small enough that the policy stays near the reference, where k3 is below verl's clamp at 10
# (a saturated token has no KL gradient).
KL = ["algorithm.name=grpo", "algorithm.kl.enable=true", "algorithm.kl.coef=0.5", "algorithm.kl.type=k3",
      "optimizer.lr=1e-5"]
MINIBATCHES = 2  # data.train_batch_size=4 / algorithm.mini_batch_size=2 (test_resume_e2e's overrides)


def _launch(script, overrides, log, env=None):
    cmd = _cmd(overrides) if script is None else [*_cmd(overrides)[:5], str(script), *overrides]
    with open(log, "w") as f:
        return subprocess.run(cmd, cwd=REPO, env={**_env(), **(env or {})}, stdout=f, stderr=subprocess.STDOUT,
                              timeout=600)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("kl")
    model = make_tiny_model_with_tokenizer(root / "model")
    here = Path(__file__).parent
    # Uninterrupted, 3 steps, every log-prob pass of rank 0 recorded.
    full = _overrides(model, root / "full", steps=3) + KL
    proc = _launch(here / "workers" / "record_logprobs.py", full, root / "full.log",
                   {"MCPO_TEST_LOGPROBS": str(root / "lp.pt")})
    assert proc.returncode == 0, (root / "full.log").read_text()[-6000:]
    # Killed after its step-2 checkpoint, then resumed for step 3.
    cut = _overrides(model, root / "cut", steps=3) + KL
    _launch(here / "workers" / "crash_after_checkpoint.py", cut, root / "cut1.log", {"MCPO_TEST_CRASH_STEP": "2"})
    killed = find_latest(root / "cut" / "checkpoints").name == "step_000002"
    proc = _launch(None, cut, root / "cut2.log")
    assert proc.returncode == 0, (root / "cut2.log").read_text()[-6000:]
    return {"root": root, "killed": killed, "calls": torch.load(root / "lp.pt")}


def test_reference_equals_the_policy_at_step_one_then_drifts_apart(runs):
    calls = runs["calls"]
    # per step and mini-batch: the policy's old log-probs, then the reference's, in the same pass
    assert [k for k, _ in calls] == ["policy", "reference"] * (3 * MINIBATCHES)
    steps = [calls[i:i + 2 * MINIBATCHES] for i in range(0, len(calls), 2 * MINIBATCHES)]
    for (_, old), (_, ref) in zip(steps[0][0::2], steps[0][1::2]):
        assert len(old) == len(ref) > 0
        assert all(torch.equal(o, r) for o, r in zip(old, ref))  # bit for bit
    for (_, old), (_, ref) in zip(steps[2][0::2], steps[2][1::2]):
        assert any(not torch.equal(o, r) for o, r in zip(old, ref))  # the policy has been updated since


def test_kl_term_acts_after_the_first_update(runs):
    recs = read_jsonl(runs["root"] / "full" / "metrics.jsonl")
    assert [r["step"] for r in recs] == [1, 2, 3]
    for r in recs:
        assert r["actor/loss"] == pytest.approx(r["actor/pg_loss"] + r["actor/kl_loss"], rel=1e-5, abs=1e-9)
    # k3 >= 0, and 0 only where the policy still equals the reference: every step after the first update
    first = next(i for i, r in enumerate(recs) if r["actor/grad_norm"] > 0)
    assert first < len(recs) - 1
    assert all(r["actor/kl_loss"] == 0 and r["actor/kl_mean"] == 0 for r in recs[:first])
    assert all(r["actor/kl_loss"] > 0 and 0 < r["actor/kl_mean"] < 1 for r in recs[first + 1:])


def test_resumed_run_keeps_the_initial_weights_as_reference(runs):
    assert runs["killed"], "the interrupted run finished before it could be killed"
    full = read_jsonl(runs["root"] / "full" / "metrics.jsonl")
    resumed = read_jsonl(runs["root"] / "cut" / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [1, 2, 3]
    assert _comparable(resumed) == _comparable(full)
    assert "resumed from" in (runs["root"] / "cut2.log").read_text()
