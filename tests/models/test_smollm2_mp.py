"""SmolLM2-135M-Instruct (builtin GGUF source) through ``mcpo check-model`` at TP=2.

SmolLM2 has 9 query heads in 3 groups, so TP=2 also exercises the zero-padded
query group.  The check's own summary must pass, and its Megatron logits are
compared here, independently, with transformers in this process.
"""

import json
import subprocess
import sys

import pytest
import torch
from mp import REPO_ROOT, run_ranks
from transformers import AutoModelForCausalLM

from mcpo_megatron.models.sources import resolve_model_path

BUILTIN = "builtin:smollm2-135m-instruct"


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    hf_dir = resolve_model_path(BUILTIN)  # converts once into the cache, before the ranks start
    dump = tmp_path_factory.mktemp("smol")
    run_ranks(REPO_ROOT / "mcpo_megatron" / "cli.py", 2,
              ["check-model", "--model", BUILTIN, "--tp", "2", "--batch", "2", "--seq-len", "16", "--dump", dump],
              timeout=400)
    return hf_dir, dump


def test_check_model_passes_at_tp2(smol):
    _, dump = smol
    summary = json.loads((dump / "summary.json").read_text())
    assert summary["ok"] is True and summary["tp"] == 2
    assert summary["export"]["tensors_compared"] == 272 and not summary["export"]["mismatched"]


def test_smollm2_logits_match_transformers(smol):
    hf_dir, dump = smol
    saved = torch.load(dump / "megatron_logits.pt")
    ids, ours = saved["input_ids"], saved["logits"]
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(ids).logits
    assert ours.shape == ref.shape == (2, 16, 49152)
    assert (ours - ref).abs().max().item() < 2e-4
    lp = torch.log_softmax(ours.double(), -1)[:, :-1].gather(-1, ids[:, 1:, None])
    lp_ref = torch.log_softmax(ref.double(), -1)[:, :-1].gather(-1, ids[:, 1:, None])
    assert (lp - lp_ref).abs().max().item() < 2e-4


def test_check_model_without_launcher_prints_torchrun_command():
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("RANK", "SLURM_PROCID")}
    env["PYTHONPATH"] = str(REPO_ROOT)
    proc = subprocess.run([sys.executable, "-m", "mcpo_megatron.cli", "check-model", "--model", "some/dir",
                           "--tp", "2", "--pp", "2"], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2
    assert "torchrun --nproc_per_node=4 -m mcpo_megatron.cli check-model --model some/dir --tp 2 --pp 2" in proc.stderr
