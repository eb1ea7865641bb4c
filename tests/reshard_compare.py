"""For multi-process workers: the compiled reshard plan against the HF stream, bit for bit.

:func:`plan_vs_stream` pushes a policy's weights into two fresh PyTorch engines on every rank: one through the HF
stream (an engine hiding its weight target), one through the compiled plan (pushed twice: the second push reuses
the compiled plan and its buffers). Every engine tensor is compared bit for bit; the figures of the plan's push
come back for the test to assert on. A collective: every rank of the world calls it.
"""

from __future__ import annotations

import torch


class StreamOnly:
    """An engine that takes the HF stream only (no weight target)."""

    def __init__(self, engine):
        self.engine = engine

    def update_weights(self, named):
        self.engine.update_weights(named)


def _poisoned(engine) -> None:
    with torch.no_grad():
        for p in engine.model.parameters():
            p.fill_(float("nan"))


def plan_vs_stream(policy, *, dtype=torch.float32, bucket_mb: float = 0.02) -> dict:
    from mcpo_megatron.rollout.weights.resharder import Resharder
    from mcpo_megatron.rollout.engines.torch.engine import TorchRolloutEngine

    cfg, info = policy.hf_config, policy.info
    by_stream = TorchRolloutEngine(cfg, dtype=dtype)
    by_plan = TorchRolloutEngine(cfg, dtype=dtype)
    _poisoned(by_stream)
    _poisoned(by_plan)
    stream = Resharder(policy.model_chunks, cfg, bucket_mb=bucket_mb, parallel_info=info).push(StreamOnly(by_stream))
    resharder = Resharder(policy.model_chunks, cfg, bucket_mb=bucket_mb, parallel_info=info)
    first = resharder.push(by_plan)
    _poisoned(by_plan)
    second = resharder.push(by_plan)
    a, b = by_stream.model.state_dict(), by_plan.model.state_dict()
    mismatch = sorted(k for k in a if not torch.equal(a[k], b[k]))
    nan = sorted(k for k in b if torch.isnan(b[k]).any())
    return dict(mismatch=mismatch, nan=nan, tensors=len(a), path=second.path, first_path=first.path,
                collectives=second.collectives, rounds=second.buckets, bytes=second.bytes,
                local_bytes=second.local_bytes, sent_bytes=second.sent_bytes, stream_path=stream.path,
                stream_collectives=stream.collectives, stream_bytes=stream.bytes)


def check_plan_vs_stream(r: dict) -> None:
    """The assertions on :func:`plan_vs_stream`'s figures (pytest side)."""
    assert (r["first_path"], r["path"], r["stream_path"]) == ("plan", "plan", "stream"), r
    assert r["mismatch"] == [] and r["nan"] == [], r
    assert r["bytes"] == r["stream_bytes"] > 0, r  # every engine tensor written once
