"""Context parallelism on 4 CPU processes against the unpacked CP=1 run: CP=2 x DP=2, CP=2 x TP=2 with sequence
parallelism, CP=2 x PP=2.

One torchrun launch (``worker_context_parallel.py``); the probe's sequences are 7 to 15 tokens long, most not a
multiple of 2 x CP = 4, and one response is empty.  Each sequence is split over the CP group in megatron's
load-balanced order and attends through the CPU's reference core attention, which gathers keys and values over
the group; log-probs, entropy, the loss, its metric sums (global denominators unchanged) and the gradient match
the unpacked run within fp32 rounding.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common import RESPONSE_LENS, grad_rel_diff, max_diff
from mp import run_ranks
from reshard_compare import check_plan_vs_stream

pytestmark = pytest.mark.multiproc

HERE = Path(__file__).resolve().parent
LAYOUTS = ("cp2", "cp2tp2_sp", "cp2pp2")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from mcpo_megatron.models.tiny import make_tiny_hf_model

    out = tmp_path_factory.mktemp("cp")
    qwen3 = make_tiny_hf_model("qwen3", out / "qwen3", seed=3)
    run_ranks(HERE / "workers" / "worker_context_parallel.py", 4, [out, qwen3], timeout=600)
    return {name: torch.load(out / f"{name}.pt", weights_only=False) for name in ("unpacked_dp4",) + LAYOUTS}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_context_parallel_logprobs_match_the_unpacked_run(run, layout):
    ref, res = run["unpacked_dp4"], run[layout]
    assert res["cp"] == 2 and ref["cp"] == 1
    assert [x.numel() for x in res["logp"]] == RESPONSE_LENS
    assert max_diff(res["logp"], ref["logp"]) < 1e-5, layout
    assert max_diff(res["entropy"], ref["entropy"]) < 1e-5, layout


@pytest.mark.parametrize("layout", LAYOUTS)
def test_context_parallel_loss_metrics_and_gradients_match_the_unpacked_run(run, layout):
    ref, res = run["unpacked_dp4"], run[layout]
    m_ref, m = ref["metrics"], res["metrics"]
    assert abs(m["loss"] - m_ref["loss"]) < 2e-6, (layout, m["loss"], m_ref["loss"])
    for key in set(m_ref) - {"loss", "num_microbatches", "num_filler_microbatches"}:
        assert abs(m[key] - m_ref[key]) <= 1e-5 * max(1.0, abs(m_ref[key])), (layout, key, m[key], m_ref[key])
    assert grad_rel_diff(res["grads"], ref["grads"]) < 2e-5, layout


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_cp_rank_holds_half_of_every_bin(run, layout):
    # a bin's sequences are padded to multiples of 2 x CP = 4 (and its row to 2 x CP x TP with sequence
    # parallelism); each CP rank holds half of it
    multiple = 4 if layout == "cp2tp2_sp" else 2
    assert all(n % multiple == 0 for n in run[layout]["local_tokens"])
    # micro-batches are counted once per data-parallel rank, not once per CP rank
    assert run[layout]["metrics"]["num_microbatches"] >= run[layout]["dp"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_weight_update_plan_equals_the_hf_stream_bit_for_bit(run, layout):
    """Context-parallel ranks hold the same weights: each engine takes its own rank's (no collective at TP 1 and
    one stage)."""
    r = run[layout]["plan_vs_stream"]
    check_plan_vs_stream(r)
    if layout == "cp2":
        assert r["collectives"] == 0 and r["sent_bytes"] == 0
