"""End to end on CPU/gloo with a tiny dense Qwen3.5 (hybrid: Gated DeltaNet layers and a gated full-attention
layer) in the form Qwen3.5 checkpoints ship in: ``Qwen3_5ForConditionalGeneration``, a vision tower and
multi-token-prediction tensors beside the language model. The real trainer at TP=2 trains the language model with
the PyTorch engine fed every step by the weight update (the GDN's conv, A_log, dt_bias and gated norm among its
tensors), then ``mcpo export`` of the final checkpoint with its transformers parity check. One run: the
engine/trainer log-prob mismatch per step after each update, a gradient, the GDN parameters moved by training in
the export, and the export in the checkpoint's own form (its vision tower and mtp tensors byte for byte)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mcpo_megatron.models.tiny import make_tiny_model_with_tokenizer, make_tiny_multimodal_qwen3_5
from mcpo_megatron.trainer.metrics import read_jsonl

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid_e2e")
    text = make_tiny_model_with_tokenizer(root / "text", family="qwen3_5", num_hidden_layers=4)
    model = make_tiny_multimodal_qwen3_5(text, root / "model")
    overrides = [
        f"model.path={model}", "model.dtype=fp32", "parallelism.tensor_model_parallel_size=2",
        "rollout.engine=torch", "rollout.n=4", "rollout.max_new_tokens=12", "rollout.generation_batch_size=32",
        "data.train=arith:ops=-,digits=1", "data.train_batch_size=8", "data.max_prompt_length=96",
        "data.max_response_length=12", "data.prompt_template=number", "data.apply_chat_template=true",
        "data.num_train_samples=64", "algorithm.mini_batch_size=4", "reward.answer_format=last_number",
        "reward.num_workers=1", "reward.timeout_s=5", "reward.overlong_buffer.enable=false",
        # a large step, so an engine left with the previous weights would show in the next step's mismatch
        "optimizer.lr=1e-3", "optimizer.weight_decay=0.0", "trainer.total_steps=3",
        f"trainer.output_dir={root / 'out'}", "trainer.max_tokens_per_microbatch=512", "checkpoint.interval=0",
        "logging.tensorboard=false",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "mcpo_megatron.cli", "train", *overrides]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    export = subprocess.run(
        [sys.executable, "-m", "mcpo_megatron.cli", "export", "--checkpoint", str(root / "out" / "checkpoints"),
         "--out", str(root / "export")], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    return read_jsonl(root / "out" / "metrics.jsonl"), export, Path(model), root, proc


def test_engine_matches_the_trainer_after_every_update(run):
    records = run[0]
    assert len(records) == 3
    for r in records:
        # fp32 engine (transformers' recurrent GDN decode) vs fp32 trainer (megatron's chunked GDN, TP=2):
        # k3 1e-11 measured; an engine that kept the previous step's weights gives orders of magnitude more
        assert r["mismatch/max_abs_logp_diff"] < 1e-3 and 0 <= r["mismatch/k3"] < 1e-8, r
        assert r["actor/skipped_steps"] == 0
    assert any(r["actor/grad_norm"] > 0 for r in records[:-1])  # a step that updated before a later rollout


def test_export_holds_the_trained_gdn_layers_in_the_checkpoints_form(run):
    _, export, model, root, train = run
    assert export.returncode == 0, (export.stdout + export.stderr)[-4000:]
    assert "parity: max |log-prob diff|" in export.stdout
    assert "2 multi-token-prediction tensors (mtp.*) not loaded" in train.stdout + train.stderr
    before = load_file(str(model / "model.safetensors"))
    after = {}
    for f in (root / "export").glob("*.safetensors"):
        after.update(load_file(str(f)))
    assert sorted(after) == sorted(before)
    for leaf in ("linear_attn.A_log", "linear_attn.dt_bias", "linear_attn.conv1d.weight", "linear_attn.norm.weight",
                 "linear_attn.in_proj_qkv.weight", "self_attn.q_proj.weight"):
        names = [n for n in before if n.startswith("model.language_model.") and n.endswith(leaf)]
        assert names and all(not torch.equal(after[n], before[n]) for n in names), leaf
    untrained = [n for n in before if n.startswith(("model.visual.", "mtp."))]
    assert len(untrained) > 2 and any(before[n].dtype == torch.bfloat16 for n in untrained)
    for n in untrained:   # copied as stored: the same dtype and values
        assert after[n].dtype == before[n].dtype and torch.equal(after[n], before[n]), n
    config = json.loads((root / "export" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"] and "vision_config" in config
    assert config["text_config"]["dtype"] == "float32"


def test_transformers_loads_the_export_with_its_vision_tower(run):
    """transformers builds the multimodal model from the export with no tensor missing (mtp.* is what it does not
    load, as from any Qwen3.5 checkpoint), and its language model is the trained one."""
    from transformers import Qwen3_5ForConditionalGeneration

    root = run[3]
    model, info = Qwen3_5ForConditionalGeneration.from_pretrained(str(root / "export"), output_loading_info=True)
    assert not info["missing_keys"] and set(info["unexpected_keys"]) <= {"mtp.fc.weight", "mtp.norm.weight"}
    exported = load_file(str(root / "export" / "model.safetensors"))
    state = model.state_dict()
    name = "model.language_model.layers.0.linear_attn.A_log"
    assert torch.equal(state[name], exported[name]) and torch.equal(state["model.visual.pos_embed.weight"],
                                                                    exported["model.visual.pos_embed.weight"])
