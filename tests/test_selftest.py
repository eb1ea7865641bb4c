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
    assert list(checks) == ["cuda", "collectives", "te_layers", "local_spec", "hybrid_layers", "train_step", "memory",
                            "batch_invariance", "engine", "reshard"]
    assert {n for n, c in checks.items() if c["status"] == SKIP} == {"cuda", "te_layers", "memory", "batch_invariance"}
    assert "needs CUDA" in checks["te_layers"]["detail"] and "no CUDA" in checks["cuda"]["detail"]
    assert checks["batch_invariance"]["detail"].startswith("needs CUDA: vLLM's batch-invariant mode is a GPU mode")
    coll = checks["collectives"]["data"]
    assert coll["exact"] and coll["cpu_flag_ok"] and coll["bus_gbps"] > 0 and coll["backend"] == "gloo"
    assert checks["local_spec"]["data"]["max_abs_logprob_diff"] < 1e-4
    hybrid = checks["hybrid_layers"]
    assert hybrid["status"] == PASS and hybrid["data"]["tp"] == 2 and hybrid["data"]["dtype"] == "float32"
    assert 0 < hybrid["data"]["max_abs_logprob_diff"] < 1e-3 and "CPU reference kernels" in hybrid["detail"]
    engine = checks["engine"]["data"]
    assert report["engine"] == "vllm" and engine["max_abs_diff"] < 1e-4 and engine["tokens"] > 0
    assert checks["reshard"]["data"]["gbps"] > 0 and checks["train_step"]["data"]["tokens_per_s"] > 0
    assert "selftest passed (6 checks; skipped: cuda, te_layers, memory, batch_invariance)" in proc.stdout
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
    from mcpo_megatron.models.tiny import tiny_hf_config
    from mcpo_megatron.planner import estimate_training_memory

    cfg = selftest_config(str(tmp_path), tiny_hf_config("qwen3"), tp=1, engine="torch", world=1)
    planned = step_plan_config(cfg, 512, 1536)
    assert (planned.data.max_prompt_length, planned.data.max_response_length) == (512, 1536)
    assert planned.model.transformer_impl == "local"  # no Transformer Engine here
    before = estimate_training_memory(model_shape(cfg), cfg, 1)
    after = estimate_training_memory(model_shape(planned), planned, 1)
    assert "attention_scores" in after and sum(t.bytes for t in after.values()) > sum(t.bytes for t in before.values())


# ------------------------------------------------------------------------------------ batch_invariance
def test_batch_invariance_check_is_skipped_without_cuda_or_vllm():
    from types import SimpleNamespace

    import torch

    from mcpo_megatron.commands.selftest_checks import check_batch_invariance

    row = check_batch_invariance(SimpleNamespace(device=torch.device("cpu")), "/m", "vllm")
    assert row.status == SKIP and row.detail.startswith("needs CUDA")
    row = check_batch_invariance(SimpleNamespace(device=torch.device("cuda", 0)), "/m", "torch")
    assert row.status == SKIP and row.detail.startswith("needs vLLM")


def test_batch_invariance_figures_tell_a_batch_dependent_engine(monkeypatch, tmp_path):
    """The check's logic on the engine of vLLM's CUDA build faked (tests/fake_vllm.py): its samples depend only on
    each request's seed, so the same requests alone and behind others agree bit for bit and the check passes; an
    engine whose log-probs move with the batch's size (GPU GEMMs and CUDA-graph padding without the mode) fails,
    as does one whose tokens then differ, naming the first difference. The engine process itself
    (commands/selftest_invariance.py) builds its engine with the mode on before vLLM starts."""
    import fake_vllm
    from fake_vllm import fake_cuda_vllm

    from mcpo_megatron.commands import selftest_invariance
    from mcpo_megatron.commands.selftest_checks import (INVARIANCE_OTHERS, INVARIANCE_PROBES,
                                                        batch_composition_figures, invariance_row)
    from mcpo_megatron.models.tiny import make_tiny_hf_model

    model = make_tiny_hf_model("qwen3", tmp_path / "m")
    built = fake_cuda_vllm(monkeypatch, gpus=1)
    out = tmp_path / "figures.json"
    assert selftest_invariance.main([model, str(out)]) == 0
    figures = json.loads(out.read_text())
    assert built[0]["dtype"] == "bfloat16" and "distributed_executor_backend" not in built[0]  # standalone
    assert os.environ["VLLM_BATCH_INVARIANT"] == "1"
    row = invariance_row(figures)
    assert row.status == PASS and row.figure == "4 of 4 identical" and figures["requests"] == [4, 16]
    assert figures["tokens"] > 4 and figures["max_abs_logprob_diff"] == 0.0

    schedule = fake_vllm.FakeEngine._schedule

    def batch_dependent(self, running, tokens_too=False):
        batch = schedule(self, running)
        drift = 1e-3 * len(batch)
        return [(rid, token + (len(batch) > 4 and tokens_too), lp + drift) for rid, token, lp in batch]

    from mcpo_megatron.rollout.engines.vllm.engine import VLLMRolloutEngine

    monkeypatch.setattr(fake_vllm.FakeEngine, "_schedule", batch_dependent)
    engine = VLLMRolloutEngine(model, standalone=True)
    row = invariance_row(batch_composition_figures(engine, INVARIANCE_PROBES, INVARIANCE_OTHERS,
                                                   selftest_invariance.SAMPLING))
    assert row.status == FAIL and row.figure.startswith("0 of 4 differ, max abs dlogp 1.20e-02")
    monkeypatch.setattr(fake_vllm.FakeEngine, "_schedule", lambda self, running: batch_dependent(self, running, True))
    row = invariance_row(batch_composition_figures(engine, INVARIANCE_PROBES, INVARIANCE_OTHERS,
                                                   selftest_invariance.SAMPLING))
    assert row.status == FAIL and row.figure.startswith("4 of 4 differ") and "first at prompt 0 sample 0 at token 0" \
        in row.detail


def test_batch_invariance_check_runs_its_engine_on_this_ranks_gpu_alone(monkeypatch):
    """The engine process sees this rank's GPU only (its entry of the launcher's CUDA_VISIBLE_DEVICES), no launcher
    variables and the mode on from its start; a failed process fails the check with its last lines."""
    from types import SimpleNamespace

    import torch

    from mcpo_megatron.commands import selftest_checks

    for var, value in dict(RANK="3", WORLD_SIZE="4", LOCAL_RANK="1", MASTER_PORT="29500",
                           CUDA_VISIBLE_DEVICES="4,5").items():
        monkeypatch.setenv(var, value)
    info = SimpleNamespace(device=torch.device("cuda", 1))
    ran = []

    def run(argv, env, **kw):
        ran.append((argv, env))
        Path(argv[-1]).write_text(json.dumps({"samples": 4, "tokens": 40, "differing_samples": 0,
                                              "max_abs_logprob_diff": 0.0, "first_difference": None,
                                              "requests": [4, 16]}))
        return SimpleNamespace(returncode=0, stdout="", stderr="")

    monkeypatch.setattr(selftest_checks.subprocess, "run", run)
    row = selftest_checks.check_batch_invariance(info, "/m", "vllm")
    (argv, env), = ran
    assert row.status == PASS and argv[1:4] == ["-c", selftest_checks.INVARIANCE_MAIN, "/m"]
    assert env["CUDA_VISIBLE_DEVICES"] == "5" and env["VLLM_BATCH_INVARIANT"] == "1"
    assert not {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"} & set(env)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert selftest_checks.invariance_env(info)["CUDA_VISIBLE_DEVICES"] == "1"
    monkeypatch.setattr(selftest_checks.subprocess, "run", lambda argv, env, **kw: SimpleNamespace(
        returncode=1, stdout="", stderr="Traceback\nRuntimeError: VLLM batch_invariant mode is not supported for X."))
    row = selftest_checks.check_batch_invariance(info, "/m", "vllm")
    assert row.status == FAIL and row.detail == ("the engine process exited with 1: Traceback / RuntimeError: VLLM "
                                                 "batch_invariant mode is not supported for X.")
