"""The reshard plan with engines on ranks of their own: 2 trainer ranks (TP=2) send their shards to 2 engine
ranks (PyTorch-engine replicas) over the bridge, two versions in a row (one torchrun launch), trainer rank 1
staging each version late (an injected delay) and both trainer ranks running training collectives while the
engines generate.

Each engine's weights after each update equal, bit for bit, the trainer's HF export of that version (a rank sends
only the version it has staged); every trainer rank staged its own part (no funnel through the leader), and the
engines took the plan. Every bridge collective of a trainer rank comes from its main thread, and both trainer
ranks make their bridge and training collectives in the same order (rollout/separate/remote.py: the fixed points).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mp import run_ranks

pytestmark = pytest.mark.multiproc

WORKER = Path(__file__).parent / "workers" / "worker_separate_reshard.py"
VERSIONS = 2


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from mcpo_megatron.models.tiny import make_tiny_hf_model

    root = tmp_path_factory.mktemp("separate_reshard")
    hf_dir = make_tiny_hf_model("qwen3", root / "qwen3", seed=3)
    out = root / "out"
    out.mkdir()
    run_ranks(WORKER, 4, [out, hf_dir], timeout=600)
    return out


def _export(path: Path) -> dict:
    from safetensors.torch import load_file

    got = {}
    for f in path.glob("*.safetensors"):
        got.update(load_file(str(f)))
    return got


@pytest.mark.parametrize("version", range(VERSIONS))
def test_every_engine_rank_gets_the_version_bit_for_bit(run, version):
    ref = _export(run / f"export_v{version}")
    for e in range(2):
        engine = torch.load(run / f"engine{e}_v{version}.pt", weights_only=True)
        assert set(engine) == set(ref)
        mismatch = sorted(k for k in ref if not torch.equal(engine[k], ref[k]))
        assert mismatch == [], (version, e, mismatch)


def test_every_trainer_rank_stages_its_own_shards(run):
    trainers = [json.loads((run / f"trainer{r}.json").read_text()) for r in range(2)]
    engines = [json.loads((run / f"engine{e}.json").read_text()) for e in range(2)]
    assert all(t["planned"] for t in trainers) and all(e["planned"] for e in engines)
    assert all(e["readers"] == 2 for e in engines)  # each offer: both engine ranks (the trainer ranks get verdicts)
    for t in trainers:
        assert [p["path"] for p in t["publish"]] == ["plan"] * VERSIONS
        # each trainer rank sends its half of the model to each of the two replicas, in many rounds
        assert t["publish"][0]["bytes"] > 0 and t["publish"][0]["rounds"] > 2
        assert t["samples"] == [8] * VERSIONS
    total = sum(t["publish"][0]["bytes"] for t in trainers)
    model = sum(v.numel() * v.element_size() for v in _export(run / "export_v0").values())
    assert 2 * model <= total < 2 * model * 1.05  # two replicas, each the whole model once (plus alignment)


def test_bridge_collectives_run_on_the_main_thread_in_the_same_order_on_every_trainer_rank(run):
    trainers = [json.loads((run / f"trainer{r}.json").read_text()) for r in range(2)]
    for t in trainers:
        assert {thread for _, thread in t["calls"]} == {"MainThread"}, t["calls"]
        sends = [what for what, _ in t["calls"]].count("bridge all_to_all")
        assert sends == VERSIONS * t["publish"][0]["rounds"]  # each version's rounds, once
    orders = [[what for what, _ in t["calls"]] for t in trainers]
    assert orders[0] == orders[1]
    # the weights went at the submit (the engines waited for the batch), before the training collectives
    per_version = orders[0][:len(orders[0]) // VERSIONS]
    assert per_version == ["bridge all_to_all"] * trainers[0]["publish"][0]["rounds"] + ["training all_reduce"] * 3
