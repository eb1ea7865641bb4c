"""Single-process pieces of resharding: bucketing and the stats."""

from __future__ import annotations

import pytest
import torch

from mcpo_megatron.rollout.weights.resharder import Resharder, ReshardStats, bucketize, tensor_bytes


def _named(sizes):
    return [(f"t{i}", torch.zeros(n, dtype=torch.float32)) for i, n in enumerate(sizes)]


def test_bucketize_respects_size_and_order():
    named = _named([10, 10, 30, 5, 100, 1, 1])  # bytes: 40, 40, 120, 20, 400, 4, 4
    buckets = list(bucketize(iter(named), 100))
    assert [[n for n, _ in b] for b in buckets] == [["t0", "t1"], ["t2"], ["t3"], ["t4"], ["t5", "t6"]]
    for b in buckets:
        size = sum(tensor_bytes(t) for _, t in b)
        assert size <= 100 or len(b) == 1
    assert [n for b in buckets for n, _ in b] == [n for n, _ in named]
    with pytest.raises(ValueError, match=r"^bucketize: bucket_bytes=0 must be >= 1$"):
        list(bucketize(iter(named), 0))


def test_resharder_names_its_own_argument():
    """The config key (reshard.bucket_mb) is the schema's to check and name; the Resharder names its argument."""
    with pytest.raises(ValueError, match=r"^Resharder: bucket_mb=0 must be > 0 \(MiB per bucket\)$"):
        Resharder([], None, bucket_mb=0)


def test_bucketize_releases_consumed_buckets():
    """Once the consumer asks for the next bucket, the previous bucket's tensors are free."""
    import gc
    import weakref

    def stream():
        for i in range(6):
            yield f"t{i}", torch.zeros(25)  # 100 bytes each

    refs = []
    for bucket in bucketize(stream(), 200):
        gc.collect()
        assert all(r() is None for r in refs), "a previous bucket is still alive"
        refs = [weakref.ref(t) for _, t in bucket]
        del bucket


def test_stats_string_mentions_rate():
    s = ReshardStats(seconds=2.0, bytes=4_000_000_000, gbps=2.0, buckets=8, max_bucket_bytes=2**29,
                     tensors=100)
    text = str(s)
    assert "2.00 GB/s" in text and "8 buckets" in text and "512.0 MiB" in text
