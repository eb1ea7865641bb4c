"""Tiny Qwen3 / Qwen2 / tied-Llama models on TP=2, PP=2, TP=2 x PP=2 (one 4-process launch).

The worker loads each HF checkpoint into Megatron (only its slices), runs a
probe through the forward-only pipeline schedule and exports back to HF; here
the logits are compared with transformers (fp32, this process) and the export
with the original safetensors, tensor by tensor.
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

WORKER = Path(__file__).parent / "workers" / "parity_worker.py"
FAMILIES = {
    "qwen3": ("qwen3", {}),
    "qwen2": ("qwen2", {}),
    "llama-tied": ("llama-tied", {}),
    # 3 query groups at TP=2: one zero group is padded in and stripped on export
    "qwen3-3groups": ("qwen3", {"num_attention_heads": 6, "num_key_value_heads": 3}),
}
LAYOUTS = ["2x1", "1x2", "2x2"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("parity")
    for seed, (name, (family, overrides)) in enumerate(FAMILIES.items()):
        make_tiny_hf_model(family, root / name, seed=seed, **overrides)
    (root / "families.json").write_text(json.dumps(list(FAMILIES)))
    ids = probe_ids(256, 2, 12, seed=0)
    torch.save(ids, root / "ids.pt")
    run_ranks(WORKER, 4, [root], timeout=400)
    refs = {}
    for name in FAMILIES:
        hf = AutoModelForCausalLM.from_pretrained(root / name, dtype=torch.float32).eval()
        with torch.no_grad():
            refs[name] = hf(ids).logits
    return root, refs, ids


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers(results, family, layout):
    root, refs, ids = results
    ours = torch.load(root / f"logits_{family}_{layout}.pt")
    ref = refs[family]
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() < 1e-5
    lp = torch.log_softmax(ours.double(), -1)[:, :-1].gather(-1, ids[:, 1:, None])
    lp_ref = torch.log_softmax(ref.double(), -1)[:, :-1].gather(-1, ids[:, 1:, None])
    assert (lp - lp_ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_export_round_trips_bit_exactly(results, family, layout):
    root, _, _ = results
    original = load_file(root / family / "model.safetensors")
    exported = load_file(root / f"export_{family}_{layout}" / "model.safetensors")
    assert set(exported) == set(original)
    for name, t in original.items():
        assert exported[name].dtype == t.dtype and torch.equal(exported[name], t), name
    cfg = json.loads((root / f"export_{family}_{layout}" / "config.json").read_text())
    src = json.loads((root / family / "config.json").read_text())
    for key in ("num_attention_heads", "num_key_value_heads", "vocab_size", "tie_word_embeddings"):
        assert cfg[key] == src[key]
    assert (root / f"export_{family}_{layout}" / "generation_config.json").is_file()
    # ordinary permissions: the temporary directory (0700) and safetensors' file mode (0600) used to stay
    from mcpo_megatron.files import current_umask

    mask = current_umask()  # the torchrun workers inherited it from this process
    export = root / f"export_{family}_{layout}"
    assert export.stat().st_mode & 0o777 == 0o777 & ~mask
    assert (export / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~mask


@pytest.mark.parametrize("layout", LAYOUTS)
def test_iter_hf_tensors_same_stream_on_every_rank(results, layout):
    root, _, _ = results
    for family in FAMILIES:
        streams = [json.loads((root / f"stream_{family}_{layout}_rank{r}.json").read_text()) for r in range(4)]
        assert all(s == streams[0] for s in streams[1:])
        original = load_file(root / family / "model.safetensors")
        names = [n for n, _ in streams[0]]
        assert sorted(names) == sorted(original) and len(names) == len(set(names))
        assert names[0] == "model.embed_tokens.weight"
        for name, total in streams[0]:
            assert total == pytest.approx(float(original[name].double().sum()), rel=0, abs=1e-9)


@pytest.mark.parametrize("layout", ["1x2", "2x2"])
def test_bf16_pipeline_stages_agree_on_dtype(results, layout):
    """bf16 with the local layer spec at PP > 1: every parameter (norms included) is bf16 on every rank, so the
    weight stream pairs tensors of one size across stages; the export is the checkpoint cast to bf16, exactly."""
    root, refs, _ = results
    for r in range(4):
        assert json.loads((root / f"bf16_dtypes_{layout}_rank{r}.json").read_text()) == ["torch.bfloat16"], r
    streams = [json.loads((root / f"stream_bf16_{layout}_rank{r}.json").read_text()) for r in range(4)]
    assert all(s == streams[0] for s in streams[1:])
    original = load_file(root / "qwen3" / "model.safetensors")
    assert sorted(n for n, _, _ in streams[0]) == sorted(original)
    assert {d for _, d, _ in streams[0]} == {"torch.bfloat16"}
    exported = load_file(root / f"export_bf16_{layout}" / "model.safetensors")
    for name, t in original.items():
        assert exported[name].dtype == torch.bfloat16 and torch.equal(exported[name], t.to(torch.bfloat16)), name
    logits, ref = torch.load(root / f"logits_bf16_{layout}.pt"), refs["qwen3"]
    assert (logits - ref).abs().max().item() < 0.05 * ref.abs().max().item()  # bf16 weights and activations


def test_sharded_export_has_index_and_loads_back(results):
    root, _, _ = results
    sharded = root / "export_sharded_qwen3_2x2"
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all((sharded / f).is_file() for f in files)
    assert files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    exported = {}
    for f in files:
        part = load_file(sharded / f)
        assert all(index["weight_map"][k] == f for k in part)
        exported.update(part)
    original = load_file(root / "qwen3" / "model.safetensors")
    assert set(exported) == set(original)
    assert all(torch.equal(exported[k], v) for k, v in original.items())
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in original.values())
    assert torch.equal(torch.load(root / "logits_sharded_qwen3_2x2.pt"), torch.load(root / "logits_qwen3_2x2.pt"))
