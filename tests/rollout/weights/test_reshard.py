"""Resharding from TP=2, PP=2 and TP=2 x PP=2 into the CPU engine (one torchrun, 4 gloo ranks).

Bit-exact weights against the HF checkpoint the policy was loaded from and against
the models package's HF export; bucket sizes; no buffer of an earlier bucket alive;
rollout DP independent of the replica count; engine vs policy
log-probs within 1e-4 (fp32).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mp import run_ranks

pytestmark = pytest.mark.multiproc

WORKER = Path(__file__).parent / "workers" / "worker_reshard.py"
LAYOUTS = ["tp2pp1", "tp1pp2", "tp2pp2"]
BUCKET_BYTES = int(0.02 * 2**20)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from mcpo_megatron.models.tiny import make_tiny_hf_model

    root = tmp_path_factory.mktemp("reshard")
    hf_dir = make_tiny_hf_model("qwen3", root / "qwen3", seed=3)
    out = root / "out"
    out.mkdir()
    run_ranks(WORKER, 4, [out, hf_dir], timeout=400)
    ref = {}
    from safetensors.torch import load_file

    for f in Path(hf_dir).glob("*.safetensors"):
        ref.update(load_file(str(f)))
    return [torch.load(out / f"result_rank{r}.pt", weights_only=False) for r in range(4)], ref


@pytest.mark.parametrize("layout", LAYOUTS)
def test_engine_weights_bit_exact(results, layout):
    per_rank, ref = results
    for r, res in enumerate(per_rank):
        got = res[layout]
        assert got["weight_mismatch"] == [], (layout, r)
        assert got["weights_missing_from_ref"] == [], (layout, r)
        assert "export_mismatch" in got, "models.hf_export.export_hf is not available"
        assert got["export_mismatch"] == [] and got["export_names"] == len(ref)
        # Every HF tensor delivered exactly once.
        assert got["stats"]["tensors"] == len(ref)
        assert got["stats"]["bytes"] == sum(t.numel() * t.element_size() for t in ref.values())


def one_parameter(names: list[str]) -> bool:
    prefixes = {n.rsplit(".", 2)[0] for n in names}
    leaves = {n.rsplit(".", 2)[1] for n in names}
    return len(prefixes) == 1 and (len(names) == 1 or leaves <= {"q_proj", "k_proj", "v_proj"}
                                   or leaves <= {"gate_proj", "up_proj"})


@pytest.mark.parametrize("layout", LAYOUTS)
def test_buckets_respect_size_and_are_released(results, layout):
    per_rank, _ = results
    for res in per_rank:
        got = res[layout]
        sizes = got["bucket_sizes"]
        assert len(sizes) == got["stats"]["buckets"] > 1
        for (nbytes, ntensors), names in zip(sizes, got["bucket_names"]):
            # a bucket over the size holds the tensors of one Megatron parameter (q/k/v, gate/up), which its
            # owner builds together
            assert nbytes <= BUCKET_BYTES or one_parameter(names), names
        assert got["stats"]["max_bucket_bytes"] == max(b for b, _ in sizes)
        assert got["max_stale_bytes"] == 0, "tensors of an earlier bucket were still alive"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_rollout_dp_independent_of_replicas(results, layout):
    per_rank, _ = results
    base = per_rank[0][layout]["dp"][4]  # one replica of 4 ranks = no rollout DP
    assert base["prompt_indices"] == [j for j in range(6) for _ in range(3)]
    for res in per_rank:
        for rtp in (1, 2, 4):
            d = res[layout]["dp"][rtp]
            assert d["tokens"] == base["tokens"], (layout, rtp)
            assert d["prompt_indices"] == base["prompt_indices"]
            worst = max(abs(a - b) for x, y in zip(d["logprobs"], base["logprobs"]) for a, b in zip(x, y))
            assert worst < 1e-5


@pytest.mark.parametrize("layout", LAYOUTS)
def test_contract_engine_vs_policy(results, layout):
    per_rank, _ = results
    for res in per_rank:
        c = res[layout]["contract"]
        assert c["tokens"] > 0
        assert c["max_abs_diff"] < 1e-4, c
        assert c["k3_kl"] < 1e-8, c
    print(layout, per_rank[0][layout]["contract"])
