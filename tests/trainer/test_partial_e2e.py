"""Partial rollouts end to end on CPU/gloo (rollout.partial; docs/algorithms.md §13), on a tiny model whose reply
lengths are long-tailed and set by the prompt (models/tiny.make_long_tail_model: most replies a few tokens, a
quarter of the prompts' replies run to the cap):

* colocated, 2 ranks (two rollout replicas, DP=2), max_staleness 1, with the token and sequence masks: each step
  trains 4 complete groups, unfinished responses continue in the next step (tokens of two versions), no prompt
  is trained twice, no token is more than one version old; a run preempted in the middle of step 3's generation
  checkpoints step 2 and resumes to exactly the uninterrupted run (whose first steps it also repeats);
* separate placement (one trainer rank with packed sequences, one engine rank), max_staleness 2: the next step's
  batch is generated while a step trains, with the unfinished responses, and takes the version that step
  publishes in flight, after its 4th segment (rollout.partial.inflight_updates=repeatable, the default): tokens 0,
  1 or 2 versions old; two runs with the same seed give the same metrics step for step; its checkpoints hold the
  batch in flight, generated, and a run preempted while it waits for a batch resumes to exactly the uninterrupted
  run;
* a mixture of experts with routing replay (r3): a continued response keeps the routing its tokens were sampled
  under, so the trainer's recomputation matches the engine's log-probs also on continued responses.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mcpo_megatron.models.tiny import make_long_tail_model, write_length_prompts
from mcpo_megatron.trainer.checkpoint import list_complete
from mcpo_megatron.trainer.metrics import is_measurement_key, read_jsonl

REPO = Path(__file__).resolve().parents[2]
RECORDER = Path(__file__).parent / "workers" / "record_trained.py"
pytestmark = pytest.mark.multiproc
STEPS = 4
GROUPS = 4


def _overrides(root, out_dir, *extra, model="model"):
    return [
        f"model.path={root / model}", "model.dtype=fp32", "rollout.n=4", "rollout.max_new_tokens=16",
        "rollout.generation_batch_size=64", "data.train=jsonl", f"data.train_path={root / 'prompts.jsonl'}",
        "data.prompt_template=raw", "data.apply_chat_template=false", f"data.train_batch_size={GROUPS}",
        "data.max_prompt_length=32", "data.max_response_length=16", "algorithm.mini_batch_size=2",
        "reward.answer_format=last_number", "reward.num_workers=1", "reward.timeout_s=5",
        "reward.overlong_buffer.enable=false", "optimizer.lr=1e-3", "optimizer.weight_decay=0.0",
        f"trainer.total_steps={STEPS}", f"trainer.output_dir={out_dir}", "trainer.max_tokens_per_microbatch=256",
        "checkpoint.interval=0", "logging.tensorboard=false",
        "rollout.partial.enable=true", "rollout.partial.segment_tokens=1", "rollout.partial.spare_groups=2", *extra,
    ]


COLOCATED = ["trainer.max_staleness=1", "algorithm.token_mask.enable=true", "algorithm.sequence_mask.enable=true"]
SEPARATE = ["rollout.placement=separate", "rollout.ranks=1", "trainer.max_staleness=2", "trainer.sequence_packing=true"]


def _launch(root, name, nproc, overrides, **env):
    trained = root / f"{name}.trained.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", MCPO_TEST_TRAINED=str(trained), **env)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(RECORDER), *overrides]
    with open(root / f"{name}.log", "a") as f:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=600)
    return proc, trained


def _run(root, name, nproc, overrides):
    proc, trained = _launch(root, name, nproc, overrides)
    assert proc.returncode == 0, (root / f"{name}.log").read_text()[-6000:]
    return read_jsonl(root / name / "metrics.jsonl"), [json.loads(x) for x in trained.read_text().splitlines()]


def _comparable(records):
    return [{k: v for k, v in r.items() if not is_measurement_key(k)} for r in records]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    r = tmp_path_factory.mktemp("partial")
    make_long_tail_model(r / "model")
    write_length_prompts(r / "prompts.jsonl", 40, long_frac=0.25)
    return r


@pytest.fixture(scope="module")
def colocated(root):
    return _run(root, "colocated", 2, _overrides(root, root / "colocated", *COLOCATED))


def _check_the_pool(trained, max_staleness):
    """Every step trains GROUPS whole groups of prompts never trained before, no token older than the bound."""
    seen = [u for t in trained for u in t["uids"]]
    assert all(len(t["uids"]) == GROUPS for t in trained) and len(seen) == len(set(seen))
    for step, t in enumerate(trained):
        for versions, length in zip(t["token_versions"], t["lengths"]):
            assert len(versions) == length and step - min(versions) <= max_staleness and max(versions) <= step


def test_colocated_steps_train_complete_groups_and_continue_the_rest(colocated):
    records, trained = colocated
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    _check_the_pool(trained, 1)
    for r in records:
        assert r["batch/groups"] == GROUPS and r["async/staleness_max"] <= 1 and r["async/stale_dropped_frac"] == 0
        assert r["partial/dropped_sequences"] == 0  # staleness_policy=wait: waited for, never dropped
        assert sum(r[f"partial/token_lag_{k}_frac"] for k in ("0", "1", "2", "3plus")) == pytest.approx(1.0)
        assert r["partial/token_lag_2_frac"] == r["partial/token_lag_3plus_frac"] == 0
    # a response started in one step and finished in the next: tokens of two versions, and a group it had to wait for
    assert max(r["partial/versions_spanned_max"] for r in records) == 2
    assert any(r["partial/due_groups"] > 0 for r in records)
    assert any(len(set(v)) == 2 for t in trained for v in t["token_versions"])
    # the first step samples version 0 only and its responses are on-policy: ratio 1, nothing masked
    assert records[0]["partial/token_lag_0_frac"] == 1 and records[0]["offpolicy/masked_token_frac"] == 0
    assert records[0]["offpolicy/ratio_min"] == pytest.approx(1, abs=1e-5) == records[0]["tis/mean"]
    # later steps train on older tokens: the behaviour ratio leaves 1 and the masks take some tokens out
    assert any(r["partial/token_lag_1_frac"] > 0 and r["offpolicy/ratio_max"] > 1.01 for r in records[1:])
    assert any(r["offpolicy/masked_token_frac"] > 0 for r in records)


def test_colocated_preempted_mid_generation_resumes_exactly(root, colocated):
    """SIGUSR1 on rank 0 as its engine starts the third segment of step 3's batch: step 2 is checkpointed with the
    pool as that step left it (the unfinished responses, their tokens, log-probs and versions), the run exits 0
    for requeue, and the resumed run is the uninterrupted one, metric for metric and sample for sample."""
    out = root / "pre"
    proc, trained = _launch(root, "pre", 2, _overrides(root, out, *COLOCATED),
                            MCPO_TEST_SIGNAL_STEP="3", MCPO_TEST_SIGNAL_SEGMENT="3")
    log = (root / "pre.log").read_text()
    assert proc.returncode == 0, log[-4000:]
    assert "received during generation: checkpointed step 2" in log
    assert (out / "PREEMPTED").read_text().strip() == "2" and [s for s, _ in list_complete(out / "checkpoints")] == [2]
    import torch

    pool = torch.load(out / "checkpoints" / "step_000002" / "trainer_state.pt", weights_only=True)["rollout_pool"]
    assert pool["groups"] and not pool["batches"]  # what step 2 left, nothing in flight colocated
    resumed, again = _run(root, "pre", 2, _overrides(root, out, *COLOCATED))
    records, want = colocated
    assert _comparable(resumed) == _comparable(records)
    assert again == want


@pytest.fixture(scope="module")
def separate(root):
    return [_run(root, name, 2, _overrides(root, root / name, *SEPARATE)) for name in ("separate", "separate_again")]


def test_separate_placement_generates_ahead_and_repeats_exactly(separate):
    (records, trained), (again, trained_again) = separate
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    _check_the_pool(trained, 2)
    # step 1 trains version 0; later steps train tokens generated while the step before trained (one version
    # old), those taken in flight after the batch's 4th segment (the version that trains them), and older ones
    assert records[0]["partial/token_lag_0_frac"] == 1
    for r in records[1:]:
        assert r["partial/token_lag_0_frac"] < 1 and r["async/staleness_max"] <= 2
    assert any(r["async/inflight_updates"] == 1 and r["partial/token_lag_0_frac"] > 0 for r in records[1:])
    assert any(len(set(v)) >= 2 and v[4] > v[3] for t in trained[1:] for v in t["token_versions"] if len(v) > 4)
    assert max(r["partial/versions_spanned_max"] for r in records) >= 2
    assert any(r["partial/token_lag_2_frac"] > 0 for r in records)
    only_separate = ("async/weight_",)
    assert [{k: v for k, v in r.items() if not k.startswith(only_separate)} for r in _comparable(again)] == \
        [{k: v for k, v in r.items() if not k.startswith(only_separate)} for r in _comparable(records)]
    assert trained_again == trained


def test_separate_placement_preempted_resumes_exactly(root, separate):
    """checkpoint.interval=2: step 2's checkpoint waits for step 3's batch, in flight (generated while step 2
    trained, taking version 2 in flight), and holds it; step 3 then trains as in the uninterrupted run. SIGUSR1 on
    the trainer's rank 0 as it waits for step 4's batch: the engines finish it, step 3 is checkpointed with the pool
    as the step found it and that batch's samples, and the run exits 0 for requeue. The resumed run trains them: it
    is the uninterrupted run, metric for metric and sample for sample (trainer/held_batches.py)."""
    import torch

    out = root / "sep_pre"

    def held(step):
        state = torch.load(out / "checkpoints" / f"step_{step:06d}" / "trainer_state.pt", weights_only=True)
        return [tuple(b["key"]) for b in state["rollout_pool"]["batches"]], [tuple(g["key"]) for g in state["generated"]]

    overrides = _overrides(root, out, *SEPARATE, "checkpoint.interval=2")
    proc, _ = _launch(root, "sep_pre", 2, overrides, MCPO_TEST_SIGNAL_STEP="4")
    log = (root / "sep_pre.log").read_text()
    assert proc.returncode == 0 and "received during generation: checkpointed step 3" in log, log[-4000:]
    assert [s for s, _ in list_complete(out / "checkpoints")] == [2, 3]
    # (in flight, generated): step 3's batch at step 2's end, step 4's at step 4's start
    assert held(2) == ([(2, 0)], [(2, 0)]) and held(3) == ([(3, 0)], [(3, 0)])
    resumed, trained = _run(root, "sep_pre", 2, overrides)
    records, want = separate[0]
    only_separate = ("async/weight_",)  # a resumed engine takes the checkpoint's weights first: one more update
    assert [{k: v for k, v in r.items() if not k.startswith(only_separate)} for r in _comparable(resumed)] == \
        [{k: v for k, v in r.items() if not k.startswith(only_separate)} for r in _comparable(records)]
    assert trained == want


def test_routing_replay_keeps_a_continued_response_consistent(root):
    """r3 with a mixture of experts whose experts move the log-probs (an expert routed wrongly moves them by up to
    about 1): the training barely moves the weights (lr 1e-9), so a response continued in the next step was sampled
    by (almost) the trainer's weights under the routing its record kept; replaying it, the trainer's log-probs
    match the engine's to fp32 rounding on every step, continued responses included."""
    make_long_tail_model(root / "moe", family="qwen3_moe", layer_scale=0.1)
    records, trained = _run(root, "moe", 1, _overrides(root, root / "moe", "trainer.max_staleness=1",
                                                       "model.moe_routing_replay=r3", "optimizer.lr=1e-9",
                                                       model="moe"))
    assert any(len(set(v)) == 2 for t in trained for v in t["token_versions"])  # continued responses trained
    for r in records:
        assert r["mismatch/max_abs_logp_diff"] < 1e-4 and 0 <= r["moe/routing_mismatch_frac"] < 0.05, r
