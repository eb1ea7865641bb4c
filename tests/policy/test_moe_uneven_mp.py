"""MoE with expert parallelism when data-parallel ranks split their shares into different numbers of
micro-batches: the passes finish (before, a rank with fewer micro-batches left its expert-parallel peer waiting
in megatron's token all-to-all: a hang) and give the results of one micro-batch per rank."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mp import run_ranks

pytestmark = pytest.mark.multiproc

HERE = Path(__file__).resolve().parent
LAYOUTS = ("ep2_dp4", "pp2_vpp2_ep2")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from mcpo_megatron.models.tiny import make_tiny_hf_model

    out = tmp_path_factory.mktemp("moe_uneven")
    model_dir = make_tiny_hf_model("qwen3_moe", out / "model", seed=7)
    run_ranks(HERE / "workers" / "worker_moe_uneven.py", 4, [out, model_dir], timeout=240)
    return {name: torch.load(out / f"{name}.pt", weights_only=False) for name in LAYOUTS}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_uneven_microbatch_counts_match_one_microbatch_per_rank(results, layout):
    res = results[layout]
    counts = res["counts"]  # real micro-batches per DP rank under the small budget
    assert len(set(counts)) > 1, counts  # the shares really split into different counts
    small = {i: v for idx, lps in res["logp_small"] for i, v in zip(idx, lps)}
    big = {i: v for idx, lps in res["logp_big"] for i, v in zip(idx, lps)}
    assert sorted(small) == sorted(big) == list(range(8))
    assert max(float((small[i] - big[i]).abs().max()) for i in big if big[i].numel()) < 1e-5
    ms, mb = res["metrics_small"], res["metrics_big"]
    assert ms["loss"] == pytest.approx(mb["loss"], rel=1e-5, abs=1e-7)
    # fillers are not counted: the real micro-batches of the small budget, summed over DP
    assert ms["num_microbatches"] == sum(counts) and mb["num_microbatches"] == len(counts)
    if layout == "ep2_dp4":  # every rank runs the busiest one's count
        assert ms["num_filler_microbatches"] == sum(max(counts) - c for c in counts) > 0
    gs, gb = res["grads_small"], res["grads_big"]
    scale = max(float(g.abs().max()) for g in gb.values())
    assert scale > 0
    assert max(float((gs[k] - gb[k]).abs().max()) for k in gb) < 1e-5 * max(scale, 1.0)
