"""megatron-core on CPU/gloo through the shim: TP=2 x PP=2 pipeline forward-backward (4 processes)."""

import json
import math
from pathlib import Path

import pytest

from mp import run_torchrun

WORKER = Path(__file__).with_name("worker_gpt_tp_pp.py")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpt_tp2_pp2")
    run_torchrun(WORKER, 4, [out, "2", "2"], timeout=400)
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(4)}


def test_layout(results):
    # megatron order tp-cp-ep-dp-pp: ranks 0,1 are stage 0, ranks 2,3 stage 1.
    assert [(r["tp_rank"], r["pp_rank"]) for r in results.values()] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert [r["is_last_stage"] for r in results.values()] == [False, False, True, True]


def test_finite_loss_on_last_stage(results):
    last = [results[2]["losses"], results[3]["losses"]]
    assert len(last[0]) == 2
    # Both TP ranks see the same (TP-reduced) loss; random init gives about ln(vocab=64).
    assert last[0] == pytest.approx(last[1], rel=1e-6)
    for loss in last[0]:
        assert math.isfinite(loss)
        assert abs(loss - math.log(64)) < 0.5


def test_every_parameter_gets_a_finite_gradient(results):
    for r in results.values():
        assert r["n_grads"] == r["n_params"] > 0
        assert math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0
