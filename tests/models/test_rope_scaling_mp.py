"""Rotary scaling at TP=2 against transformers (one 2-process launch): Llama-3.1's ``llama3`` scaling and
Qwen's ``yarn`` (its attention factor applied by megatron's attention through yarn_mscale).

The probe is long enough that the scaling matters: the same weights without scaling move the logits by far
more than the tolerance (checked here too), so a dropped or wrong scaling cannot pass.
"""

import json
from pathlib import Path

import pytest
import torch
from mp import run_ranks
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from mcpo_megatron.models.parity import probe_ids
from mcpo_megatron.models.tiny import make_tiny_hf_model

pytestmark = pytest.mark.multiproc

WORKER = Path(__file__).parent / "workers" / "rope_worker.py"
SEQ = 48
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
MODELS = {  # family, rope_theta, rope_parameters, max_position_embeddings
    "llama3": ("llama", 500000.0, LLAMA3, 16384),
    "yarn": ("qwen3", 1000000.0, YARN, 128),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("rope")
    for seed, (name, (family, theta, rope, max_pos)) in enumerate(MODELS.items()):
        make_tiny_hf_model(family, root / name, seed=seed, rope_theta=theta, max_position_embeddings=max_pos,
                           rope_parameters=dict(rope, rope_theta=theta))
    (root / "names.json").write_text(json.dumps(list(MODELS)))
    ids = probe_ids(256, 2, SEQ, seed=0)
    torch.save(ids, root / "ids.pt")
    run_ranks(WORKER, 2, [root], timeout=400)
    return root, ids


def hf_logits(path, ids, **overrides):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **overrides).eval()
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("name", list(MODELS))
def test_logits_match_transformers_at_tp2(results, name):
    root, ids = results
    ref = hf_logits(root / name, ids)
    ours = torch.load(root / f"logits_{name}.pt")
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() <= 1e-4, (ours - ref).abs().max().item()


@pytest.mark.parametrize("name", list(MODELS))
def test_probe_is_sensitive_to_the_scaling(results, name):
    root, ids = results
    theta = MODELS[name][1]
    unscaled = hf_logits(root / name, ids, rope_parameters={"rope_type": "default", "rope_theta": theta})
    assert (unscaled - hf_logits(root / name, ids)).abs().max().item() > 100 * 1e-4


@pytest.mark.parametrize("name", list(MODELS))
def test_export_round_trips_with_the_scaling(results, name):
    root, _ = results
    original, exported = load_file(root / name / "model.safetensors"), load_file(
        root / f"export_{name}" / "model.safetensors")
    assert set(original) == set(exported) and all(torch.equal(exported[k], t) for k, t in original.items())
    cfg = json.loads((root / f"export_{name}" / "config.json").read_text())
    assert cfg["rope_parameters"]["rope_type"] == MODELS[name][2]["rope_type"]
    assert cfg["rope_parameters"]["factor"] == MODELS[name][2]["factor"]
