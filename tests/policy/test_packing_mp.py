"""Packed (THD) micro-batches against padded ones on 4 CPU processes: TP2 x PP2, PP2 x DP2, TP2 x DP2 with
sequence parallelism, PP2 x VPP2 x DP2, and a Qwen3-MoE at EP2 x DP4.

One torchrun launch (``worker_packing.py``) runs every layout with the same model and batch; each layout's
padded run is the reference of its packed run: log-probs, entropy, the loss, its metric sums and the gradient
agree within fp32 rounding.  The packed path's attention on CPU is the reference core attention
(``parallel/cpu_attention.py``), which the padded path does not use.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common import PROMPT_LENS, RESPONSE_LENS, grad_rel_diff, max_diff
from mp import run_ranks

pytestmark = pytest.mark.multiproc

HERE = Path(__file__).resolve().parent
LAYOUTS = ("tp2pp2", "pp2dp2", "tp2dp2_sp", "vpp2", "moe_ep2")
PACK_BUDGET = 24  # worker_packing.PACK_BUDGET


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from mcpo_megatron.models.tiny import make_tiny_hf_model

    out = tmp_path_factory.mktemp("packing")
    qwen3 = make_tiny_hf_model("qwen3", out / "qwen3", seed=3)
    moe = make_tiny_hf_model("qwen3_moe", out / "moe", seed=5)
    run_ranks(HERE / "workers" / "worker_packing.py", 4, [out, qwen3, moe], timeout=900)
    return {name: torch.load(out / f"{name}.pt", weights_only=False) for name in LAYOUTS}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_packed_logprobs_match_padded(run, layout):
    res = run[layout]
    padded, packed = res["padded"], res["packed"]
    assert [x.numel() for x in packed["logp"]] == RESPONSE_LENS  # per sequence, the empty response included
    assert max_diff(packed["logp"], padded["logp"]) < 1e-5, layout
    assert max_diff(packed["entropy"], padded["entropy"]) < 1e-5, layout


@pytest.mark.parametrize("layout", LAYOUTS)
def test_packed_loss_metrics_and_gradients_match_padded(run, layout):
    padded, packed = run[layout]["padded"], run[layout]["packed"]
    m_pad, m_pack = padded["metrics"], packed["metrics"]
    assert abs(m_pack["loss"] - m_pad["loss"]) < 2e-6, (layout, m_pack["loss"], m_pad["loss"])
    counts = {k for k in m_pad if k not in ("loss", "num_microbatches", "num_filler_microbatches")}
    for key in counts:  # the metric sums (clipped tokens, hinge-active tokens, entropy, ...) read the same tokens
        assert abs(m_pack[key] - m_pad[key]) <= 1e-5 * max(1.0, abs(m_pad[key])), (layout, key)
    assert set(packed["grads"]) == set(padded["grads"])
    assert grad_rel_diff(packed["grads"], padded["grads"]) < 2e-5, layout


@pytest.mark.parametrize("layout", LAYOUTS)
def test_bins_hold_whole_sequences_within_the_budget(run, layout):
    res = run[layout]
    lengths = [p + r for p, r in zip(PROMPT_LENS, RESPONSE_LENS)]
    bins = [b for rank_bins, _ in res["packed"]["bins"] for b in rank_bins]
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))  # every sequence once, never split
    assert all(sum(lengths[i] for i in b) <= PACK_BUDGET for b in bins)
    # a bin whose longest sequence is longer than the rest of it together
    assert any(len(b) > 1 and 2 * max(lengths[i] for i in b) > sum(lengths[i] for i in b) for b in bins)
    assert res["packed"]["metrics"]["num_microbatches"] > res["dp"]  # several bins per rank


def test_expert_parallel_ranks_run_equal_bin_counts(run):
    """Ranks that share an expert-parallel group run as many bins (fillers make up the difference)."""
    per_rank = run["moe_ep2"]["packed"]["bins"]
    totals = {len(b) + fillers for b, fillers in per_rank}
    assert len(totals) == 1
    assert sum(f for _, f in per_rank) == run["moe_ep2"]["packed"]["metrics"]["num_filler_microbatches"]


def test_virtual_pipeline_runs_a_multiple_of_the_pipeline_size(run):
    assert all((len(bins) + fillers) % 2 == 0 for bins, fillers in run["vpp2"]["packed"]["bins"])


def test_frozen_reference_packed_matches_the_policy(run):
    res = run["pp2dp2"]
    assert max_diff(res["reference_logp"], res["padded"]["logp"]) < 1e-5


def test_packed_run_resumed_from_a_checkpoint_steps_like_the_uninterrupted_one(run):
    m_run, m_resumed, params_diff = run["pp2dp2"]["resume"]
    assert m_run["loss"] == m_resumed["loss"] and m_run["grad_norm"] == m_resumed["grad_norm"]
    assert params_diff == 0.0
