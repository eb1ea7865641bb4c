"""The k3 estimator of KL(engine || trainer): one definition, and the three places that report it agree."""

import math
from types import SimpleNamespace

import pytest
import torch

from mcpo_megatron.algorithms import LossInputs, finalize_metrics
from mcpo_megatron.algorithms.kl import k3

F64 = torch.float64


def _samples(seed=0, B=4, T=6):
    g = torch.Generator().manual_seed(seed)
    lengths = [6, 3, 5, 1]
    mask = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
    engine = -3 * torch.rand(B, T, generator=g, dtype=F64)
    trainer = engine + 0.5 * torch.randn(B, T, generator=g, dtype=F64)
    return lengths, mask, engine, trainer


def _reference_mean(lengths, engine, trainer):
    """KL(engine || trainer) by k3 on tokens sampled from the engine, as plain float64 Python."""
    values = []
    for i, n in enumerate(lengths):
        for t in range(n):
            x = float(trainer[i, t]) - float(engine[i, t])  # log p_trainer - log p_engine
            values.append(math.exp(x) - 1.0 - x)
    return sum(values) / len(values)


def test_k3_is_the_unbiased_estimator_of_kl_from_the_sampling_side():
    x = torch.tensor([-3.0, -0.5, 0.0, 1e-6, 0.7, 4.0], dtype=F64)
    want = torch.tensor([math.exp(v) - 1.0 - v for v in x.tolist()], dtype=F64)
    torch.testing.assert_close(k3(x), want, rtol=1e-9, atol=1e-15)
    assert (k3(x) >= 0).all() and k3(torch.zeros(())).item() == 0.0
    # small |x|: expm1 keeps the x^2/2 leading term where e^x - 1 - x in float32 would cancel to 0
    small = torch.tensor(1e-4, dtype=torch.float32)
    assert k3(small).item() == pytest.approx(0.5e-8, rel=1e-3)
    # E_q[k3(log p/q)] = KL(q || p) exactly for discrete q, p (samples weighted by q)
    q = torch.tensor([0.5, 0.3, 0.2], dtype=F64)
    p = torch.tensor([0.2, 0.5, 0.3], dtype=F64)
    assert float((q * k3(p.log() - q.log())).sum()) == pytest.approx(float((q * (q / p).log()).sum()), rel=1e-12)


def test_loss_metric_reports_kl_engine_to_trainer(loss_fn):
    lengths, mask, engine, trainer = _samples()
    w = mask.to(F64) / mask.sum()
    logp = trainer.clone().requires_grad_(True)
    _, sums = loss_fn(LossInputs(logp, trainer, torch.zeros(4, dtype=F64), w, mask, rollout_logp=engine))
    assert finalize_metrics(sums)["rollout/mismatch_k3"] == pytest.approx(
        _reference_mean(lengths, engine, trainer), rel=1e-12)


def test_check_rollout_reports_kl_engine_to_trainer():
    from mcpo_megatron.rollout.engines.contract import contract_figures

    lengths, _, engine, trainer = _samples()
    figures = contract_figures([engine[i, :n].tolist() for i, n in enumerate(lengths)],
                               [trainer[i, :n] for i, n in enumerate(lengths)])
    assert figures["k3_kl"] == pytest.approx(_reference_mean(lengths, engine, trainer), rel=1e-12)


def test_step_metric_reports_kl_engine_to_trainer():
    from mcpo_megatron.trainer.metrics import rollout_mismatch

    lengths, _, engine, trainer = _samples()
    mb = SimpleNamespace(token_fields={"old_logp": [trainer[i, :n].float() for i, n in enumerate(lengths)],
                                       "rollout_logp": [engine[i, :n].float() for i, n in enumerate(lengths)]})
    plan = SimpleNamespace(minibatches=[mb], local_samples=[list(range(len(lengths)))])
    rollouts = SimpleNamespace(gcpo_injected=torch.zeros(len(lengths), dtype=torch.bool))
    got = rollout_mismatch(plan, rollouts, SimpleNamespace(dp_group=None))
    want = _reference_mean(lengths, engine.float().double(), trainer.float().double())
    assert got["mismatch/k3"] == pytest.approx(want, rel=1e-9)
