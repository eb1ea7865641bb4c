"""``mcpo selftest`` on this CPU machine: the CPU subset passes (gloo, local spec vs transformers, the vLLM engine
after a reshard, a training step) and says which GPU checks it skipped; a failing check sets the exit status."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mcpo_megatron.commands.selftest import FAIL, PASS, SKIP, CheckResult, summarize

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def selftest(tmp_path_factory):
    out = tmp_path_factory.mktemp("selftest") / "selftest.json"
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "mcpo_megatron.cli", "selftest", "--nproc", "2", "--json", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    return proc, json.loads(out.read_text()) if out.is_file() else None


def test_cpu_subset_passes_and_names_the_skipped_gpu_checks(selftest):
    proc, report = selftest
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
    checks = {c["name"]: c for c in report["checks"]}
    assert list(checks) == ["cuda", "collectives", "te_layers", "local_spec", "train_step", "memory", "engine",
                            "reshard"]
    assert {n for n, c in checks.items() if c["status"] == SKIP} == {"cuda", "te_layers", "memory"}
    assert "needs CUDA" in checks["te_layers"]["detail"] and "no CUDA" in checks["cuda"]["detail"]
    coll = checks["collectives"]["data"]
    assert coll["exact"] and coll["cpu_flag_ok"] and coll["bus_gbps"] > 0 and coll["backend"] == "gloo"
    assert checks["local_spec"]["data"]["max_abs_logprob_diff"] < 1e-4
    engine = checks["engine"]["data"]
    assert report["engine"] == "vllm" and engine["max_abs_diff"] < 1e-4 and engine["tokens"] > 0
    assert checks["reshard"]["data"]["gbps"] > 0 and checks["train_step"]["data"]["tokens_per_s"] > 0
    assert "selftest passed (5 checks; skipped: cuda, te_layers, memory)" in proc.stdout
    assert "| engine | PASS |" in proc.stdout  # the table


def test_a_failed_check_fails_the_run_and_is_named():
    results = [CheckResult("cuda", SKIP, "-", "no CUDA"), CheckResult("engine", FAIL, "k3 1e-1", "a|b"),
               CheckResult("collectives", PASS, "1 GB/s", "ok"), CheckResult("te_layers", FAIL, "-", "boom")]
    status, table = summarize(results)
    assert status == 1 and table.endswith("selftest FAILED: engine, te_layers")
    assert "| engine | FAIL | k3 1e-1 | a\\|b |" in table  # a '|' in a cell does not split the row
    assert summarize(results[:1] + results[2:3])[0] == 0


def cuda_check_over_ranks(monkeypatch, uuids: list[str]) -> list[CheckResult]:
    """check_cuda on one thread per rank of one node, CUDA mocked: rank r sees one device, index 0 (a binding of
    one GPU per task) whose UUID is ``uuids[r]``; the all-gather is a barrier between the threads."""
    import threading
    from types import SimpleNamespace

    import torch

    from mcpo_megatron.commands.selftest_checks import check_cuda
    from mcpo_megatron.parallel import distributed as D

    n = len(uuids)
    barrier, slots, results, me = threading.Barrier(n, timeout=30), [None] * n, [None] * n, threading.local()

    def all_gather_objects(obj, group=None):
        slots[me.rank] = obj
        barrier.wait()
        gathered = list(slots)
        barrier.wait()
        return gathered

    def props(device=None):
        return SimpleNamespace(name="NVIDIA H100 80GB HBM3", major=9, minor=0, total_memory=80 * 2**30,
                               uuid=uuids[me.rank])

    monkeypatch.setattr(D, "all_gather_objects", all_gather_objects)
    monkeypatch.setattr(torch.cuda, "get_device_properties", props)

    def rank(r):
        me.rank = r
        results[r] = check_cuda(SimpleNamespace(rank=r, world_size=n, device=torch.device("cuda", 0)))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def test_cuda_check_tells_ranks_apart_by_device_uuid(monkeypatch):
    """Under a binding of one GPU per task every rank's device is index 0: different GPUs, which pass; two ranks
    on one physical GPU (the same UUID) fail, naming the ranks."""
    distinct = cuda_check_over_ranks(monkeypatch, [f"GPU-{r}aaa" for r in range(4)])
    assert [r.status for r in distinct] == [PASS] * 4, distinct[0].detail
    assert distinct[0].figure == "4 x NVIDIA H100 80GB HBM3"
    assert [d["uuid"] for d in distinct[0].data["ranks"]] == [f"GPU-{r}aaa" for r in range(4)]
    shared = cuda_check_over_ranks(monkeypatch, ["GPU-0aaa", "GPU-1aaa", "GPU-0aaa", "GPU-3aaa"])
    assert [r.status for r in shared] == [FAIL] * 4
    assert "ranks 0, 2 share GPU GPU-0aaa" in shared[0].detail, shared[0].detail


def test_memory_check_plans_the_step_it_runs(tmp_path):
    """The train-step check runs 2,048-token sequences on the layers this machine has (local without Transformer
    Engine): the plan it is measured against must be of that step, not of the engine check's 40-token samples
    with Transformer Engine's attention (which under-planned a GPU run without TE by about 2x)."""
    from mcpo_megatron.commands.selftest import selftest_config
    from mcpo_megatron.commands.selftest_checks import step_plan_config
    from mcpo_megatron.config import model_shape
    from mcpo_megatron.models.sources import tiny_hf_config
    from mcpo_megatron.planner import estimate_training_memory

    cfg = selftest_config(str(tmp_path), tiny_hf_config("qwen3"), tp=1, engine="torch", world=1)
    planned = step_plan_config(cfg, 512, 1536)
    assert (planned.data.max_prompt_length, planned.data.max_response_length) == (512, 1536)
    assert planned.model.transformer_impl == "local"  # no Transformer Engine here
    before = estimate_training_memory(model_shape(cfg), cfg, 1)
    after = estimate_training_memory(model_shape(planned), planned, 1)
    assert "attention_scores" in after and sum(t.bytes for t in after.values()) > sum(t.bytes for t in before.values())
