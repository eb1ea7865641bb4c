"""End to end on CPU/gloo with a tiny Qwen3-MoE: the real trainer at EP=2 (2 ranks, DP=2), the CPU engine fed
expert weights by the resharder, then ``mcpo export`` of the final checkpoint (saved at EP=2, loaded at EP=1)
with its transformers parity check (once: the routing-replay modes and placements save the same EP=2 checkpoint).
Per step: the engine/trainer log-prob mismatch and the expert load."""

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

TRAIN = "arith:ops=-,digits=1"

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.multiproc


EXPORTED = "off"  # the one run exported: the others save the same EP=2 checkpoint


# "r3-separate": the engine on a third rank of its own (rollout.placement=separate): its routing travels with the
# samples to the trainer ranks
@pytest.fixture(scope="module", params=[EXPORTED, "r2", "r3", "r3-separate"])
def run(request, tmp_path_factory):
    replay, _, placement = request.param.partition("-")
    root = tmp_path_factory.mktemp(f"moe_e2e_{request.param}")
    model = make_tiny_model_with_tokenizer(root / "model", family="qwen3_moe")
    # GCPO references give the (mostly wrong) random model's groups mixed rewards, hence a gradient
    records, _ = load_prompts(TRAIN, num_samples=32, seed=0, template="number")
    refs = root / "references.jsonl"
    refs.write_text("".join(json.dumps({"uid": r.uid, "response": r.ground_truth}) + "\n" for r in records))
    overrides = [
        f"model.path={model}", "model.dtype=fp32", "parallelism.expert_model_parallel_size=2",
        "rollout.n=8", "rollout.max_new_tokens=1", "rollout.generation_batch_size=16",
        f"data.train={TRAIN}", "data.train_batch_size=4", "data.max_prompt_length=64",
        "data.max_response_length=2", "data.prompt_template=number", "data.num_train_samples=32",
        "algorithm.mini_batch_size=2", "algorithm.gcpo.enable=true", f"algorithm.gcpo.references={refs}",
        "reward.answer_format=last_number", "reward.num_workers=1",
        "reward.timeout_s=5", "reward.overlong_buffer.enable=false", "optimizer.lr=1e-3",
        "optimizer.weight_decay=0.0", "trainer.total_steps=2", f"trainer.output_dir={root / 'out'}",
        "trainer.max_tokens_per_microbatch=256", "checkpoint.interval=0", "logging.tensorboard=false",
        f"model.moe_routing_replay={replay}",
        *(["rollout.placement=separate", "rollout.ranks=1"] if placement else []),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={3 if placement else 2}",
           "-m", "mcpo_megatron.cli", "train", *overrides]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    export = None if request.param != EXPORTED else subprocess.run(
        [sys.executable, "-m", "mcpo_megatron.cli", "export", "--checkpoint", str(root / "out" / "checkpoints"),
         "--out", str(root / "export")], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    return read_jsonl(root / "out" / "metrics.jsonl"), export, root, replay


def test_steps_report_mismatch_and_expert_load(run):
    records, _, _, replay = run
    assert len(records) == 2
    for r in records:
        # fp32 engine (transformers) vs fp32 trainer (megatron, experts split over 2 ranks)
        assert r["mismatch/max_abs_logp_diff"] < 1e-4 and 0 <= r["mismatch/k3"] < 1e-8, r
        assert r["moe/aux_loss"] > 0 and r["moe/max_expert_load"] >= 1.0 >= r["moe/min_expert_load"] >= 0
        assert r["actor/skipped_steps"] == 0
        if replay == "r3":
            # the engine's routing replayed in every pass: the trainer's own choice would differ on a fraction
            assert 0 <= r["moe/routing_mismatch_frac"] < 0.5, r
        elif replay == "r2":
            # the old-log-prob pass's routing replayed in the updates (the first update's weights are the old
            # ones, so only other micro-batch shapes could flip a choice)
            assert 0 <= r["moe/routing_mismatch_frac"] < 0.5, r
        else:
            assert "moe/routing_mismatch_frac" not in r
    # groups with mixed rewards (GCPO references where all sampled answers were wrong) give a gradient
    assert all(r["actor/grad_norm"] > 0 for r in records)


@pytest.mark.parametrize("run", [EXPORTED], indirect=True)
def test_export_of_expert_parallel_checkpoint(run):
    _, export, root, _ = run
    assert export.returncode == 0, (export.stdout + export.stderr)[-4000:]
    assert "parity: max |log-prob diff|" in export.stdout
    from safetensors.torch import load_file

    tensors = load_file(str(root / "export" / "model.safetensors"))
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in tensors and "model.layers.0.mlp.gate.weight" in tensors
