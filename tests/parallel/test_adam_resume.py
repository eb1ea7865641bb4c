"""Adam's step across a checkpoint on megatron-core's torch-Adam path (no Transformer Engine or Apex FusedAdam: a
CPU, or a GPU without them). One run of ``workers/worker_adam_resume.py`` (a world of one, about 10 s); the
reference is AdamW in float64, written out here."""

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mcpo_megatron.parallel import mcore_compat
from mp import REPO_ROOT

WORKER = Path(__file__).parent / "workers" / "worker_adam_resume.py"
ATOL = 1e-6  # float32 parameters against the float64 reference, after K + M steps of size about lr


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    if not mcore_compat.uses_torch_adam():
        pytest.skip("Transformer Engine's or Apex's FusedAdam is installed: megatron-core does not run torch's Adam")
    out = tmp_path_factory.mktemp("adam_resume")
    env = {"PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, str(WORKER), str(out)], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    res = torch.load(out / "result.pt", weights_only=False)
    assert res["torch_adam"]
    return res


def adamw_float64(initial: dict, grads: list[dict], s: dict) -> dict:
    """AdamW as Loshchilov & Hutter write it (bias-corrected moments), in float64."""
    lr, b1, b2, eps, wd = s["lr"], s["adam_beta1"], s["adam_beta2"], s["adam_eps"], s["weight_decay"]
    out = {}
    for name, p0 in initial.items():
        p, m, v = p0.double(), torch.zeros_like(p0, dtype=torch.float64), torch.zeros_like(p0, dtype=torch.float64)
        for t, g in enumerate((step[name].double() for step in grads), start=1):
            p = p * (1 - lr * wd)
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * g * g
            m_hat, v_hat = m / (1 - b1 ** t), v / (1 - b2 ** t)
            p = p - lr * m_hat / (v_hat.sqrt() + eps)
        out[name] = p
    return out


def max_error(final: dict, reference: dict) -> float:
    return max(float((final[k].double() - reference[k]).abs().max()) for k in reference)


def test_resumed_steps_and_updates_equal_the_uninterrupted_run_and_float64_adamw(result):
    K, M = result["K"], result["M"]
    resumed = result["resumed"]
    n = resumed["steps_after_load"]["n"]
    # Every parameter has a step of its own, the checkpoint's, and counts each later step once.
    assert resumed["steps_after_load"]["distinct_tensors"] == n > 1
    assert resumed["steps_after_load"]["values"] == [float(K)] * n
    assert resumed["steps_end"]["values"] == [float(K + M)] * n == result["uninterrupted"]["steps_end"]["values"]
    for name, p in result["uninterrupted"]["final"].items():
        assert torch.equal(resumed["final"][name], p), name
    reference = adamw_float64(result["initial"], result["grads"], result["settings"])
    assert max_error(result["uninterrupted"]["final"], reference) < ATOL
    assert max_error(resumed["final"], reference) < ATOL


def test_megatrons_load_alone_shares_one_step_as_on_a_gpu_without_te(result):
    """What the repair is for, as the pinned releases do it on this path (0.16.1 optimizer/distrib_optimizer.py
    817-825 and 940, 0.19.2 1024-1032 and 1225): one step tensor for every parameter, holding the loading
    placeholder's step (1) rather than the checkpoint's, which torch's AdamW then increments once per parameter.
    The CPU run sees it because nothing of the CPU support changes megatron's optimizer."""
    K, M = result["K"], result["M"]
    alone = result["megatron_only"]
    n = alone["steps_after_load"]["n"]
    assert alone["steps_after_load"]["distinct_tensors"] == 1
    assert alone["steps_after_load"]["values"] == [1.0] * n != [float(K)] * n
    assert alone["steps_end"]["values"] == [1.0 + n * M] * n
    # The wrong bias correction shows in the parameters: far outside the tolerance the repaired run meets.
    reference = adamw_float64(result["initial"], result["grads"], result["settings"])
    assert max_error(alone["final"], reference) > 100 * ATOL
    assert math.isfinite(max_error(alone["final"], reference))
