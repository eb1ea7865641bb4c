"""R3's routing stays on the ranks of the rollout replica that generated it and reaches each rank only for the
samples it trains (4 gloo ranks, two rollout replicas of TP=2; worker_fetch_routing.py)."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mp import run_ranks  # noqa: E402

WORKER = Path(__file__).parent / "workers" / "worker_fetch_routing.py"
pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("fetch_routing")
    run_ranks(WORKER, 4, [out], timeout=300)
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(4)}


def test_each_replica_keeps_only_its_own_routing(results):
    # prompts 0-2 (samples 0-5) on replica 0 (ranks 0, 1), prompts 3-4 (samples 6-9) on replica 1 (ranks 2, 3)
    for rank, res in results.items():
        assert res["routing_ranks"] == [0] * 6 + [2] * 4
        assert res["held_after_generation"] == (list(range(6)) if rank < 2 else list(range(6, 10)))


def test_each_rank_gets_exactly_the_samples_it_asked_for(results):
    # after keeping groups 4, 1, 3: samples (p, s) = (4,0) (4,1) (1,0) (1,1) (3,0) (3,1), routing 1000 p + s of
    # shape [prompt 3 + response (p + s + 1) - 1, layers 3, top-2]
    expected = {0: (4000, 7), 1: (4001, 8), 2: (1000, 4), 3: (1001, 5), 4: (3000, 6), 5: (3001, 7)}
    needed = {0: [0, 5], 1: [1, 2, 3], 2: [], 3: [0, 1, 2, 3, 4, 5]}
    for rank, res in results.items():
        for i in range(6):
            got = res["got"][str(i)]
            if i in needed[rank]:
                value, tokens = expected[i]
                assert got == [value, value, [tokens, 3, 2]], (rank, i, got)
            else:
                assert got is None, (rank, i, got)
