"""``mcpo export`` of a bf16 mixture-of-experts checkpoint (a tiny Qwen3-MoE trained one step with the MoE recipe's
options at TP=2 with sequence parallelism, saved by the trainer's checkpoint manager), run in the 2 worker
processes with the policy, megatron's DDP and the optimizer builder recorded: the export builds none of them (only
bare model chunks), its parity check passes at the fp32 tolerance on both ranks (in bf16 on both sides this
checkpoint differs by 0.2 in log-prob: rounding flips experts), and the bf16 export holds exactly the checkpoint's
values."""

import json
import re
from pathlib import Path

import pytest
from mp import run_ranks

WORKER = Path(__file__).parent / "workers" / "export_worker.py"
pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("export_bf16_moe")
    run_ranks(WORKER, 2, [root, "0"], timeout=300)
    ranks = [json.loads((root / f"rank_{r}.json").read_text()) for r in range(2)]
    return ranks, json.loads((root / "compare.json").read_text())


def test_export_builds_no_policy_ddp_or_optimizer(run):
    ranks, _ = run
    assert [r["training_machinery"] for r in ranks] == [[], []]
    assert [r["rc"] for r in ranks] == [0, 0], ranks[0]["stdout"] + ranks[0]["stderr"]


def test_bf16_moe_checkpoint_passes_parity_in_fp32(run):
    ranks, _ = run
    assert [r["rc"] for r in ranks] == [0, 0], ranks[0]["stdout"] + ranks[0]["stderr"]
    out = ranks[0]["stdout"]
    assert "(TP=2, PP=1) in fp32; exporting to" in out and "in bf16" in out
    worst = float(re.search(r"parity: max \|log-prob diff\| .* = (\S+) \(fp32 on both sides, tolerance 0.0001\)",
                            out).group(1))
    assert 0 <= worst < 1e-4


def test_bf16_export_holds_the_checkpoint_values(run):
    _, compare = run
    assert compare["trained"]["mismatched"]  # the checkpoint is a trained one, not the initial model
    export = compare["export"]
    # every tensor bf16 and equal to the training policy's bf16 weights
    assert export["tensors_compared"] == 45 and compare["config_dtype"] == "bfloat16"
    assert export["mismatched"] == [] and export["missing_in_export"] == [] and export["extra_in_export"] == []
