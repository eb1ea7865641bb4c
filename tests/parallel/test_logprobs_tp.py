"""vocab_parallel_logprobs at TP=2 (2 gloo processes) against the full-vocabulary float64 reference.

Tolerance 1e-6 absolute plus 1e-6 relative: fp32 spacing at |log p| ~ 10 is ~1e-6.
"""

import importlib.util
from pathlib import Path

import pytest
import torch

from mp import run_ranks

WORKER = Path(__file__).parent / "workers" / "worker_logprobs_tp.py"
_spec = importlib.util.spec_from_file_location("worker_logprobs_tp", WORKER)
_worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_worker)
CASES, case_inputs = _worker.CASES, _worker.case_inputs
TP = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("logprobs_tp")
    run_ranks(WORKER, TP, [out], timeout=300)
    return [torch.load(out / f"rank{r}.pt") for r in range(TP)]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_tp2_equals_single_process_reference(ranks, case):
    name, shape, vocab, temp, _chunk, ent, _inplace = case
    logits, targets, w_lp, w_h = case_inputs(shape, vocab, seed=100 + CASES.index(case))
    x = logits.double().requires_grad_(True)
    logp_all = torch.log_softmax(x / temp, dim=-1)
    ref_logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ref_ent = -(logp_all.exp() * logp_all).sum(-1)
    ((w_lp.double() * ref_logp).sum() + ((w_h.double() * ref_ent).sum() if ent else 0)).backward()

    for r, rank in enumerate(ranks):
        assert rank["tp"] == TP and rank["tp_rank"] == r
        got = rank["results"][name]
        vp = got["vp"]
        torch.testing.assert_close(got["logp"].double(), ref_logp.detach(), rtol=1e-6, atol=1e-6)
        if ent:
            torch.testing.assert_close(got["entropy"].double(), ref_ent.detach(), rtol=1e-6, atol=1e-6)
        else:
            assert got["entropy"] is None
        ref_grad = x.grad[..., r * vp:(r + 1) * vp]
        torch.testing.assert_close(got["grad"].double(), ref_grad, rtol=1e-6, atol=1e-6)
