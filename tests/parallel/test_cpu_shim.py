"""The CPU shim, applied in a separate process (it patches torch process-wide)."""

from pathlib import Path

import pytest
import torch

from mp import run_json_worker

from mcpo_megatron.parallel.cpu_shim import skip_single_rank_copy

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the shim is a no-op with CUDA")


@pytest.fixture(scope="module")
def shim(tmp_path_factory):
    return run_json_worker(Path(__file__).parent / "workers" / "worker_cpu_shim.py",
                           tmp_path_factory.mktemp("shim") / "shim.json", timeout=300)


def test_idempotent(shim):
    assert shim["first"] is True and shim["second"] is True


def test_cuda_devices_map_to_cpu(shim):
    assert shim["current_device"] == "cpu"
    assert shim["zeros_device"] == shim["tensor_cuda_device"] == shim["to_cuda_device"] == "cpu"
    assert shim["int_device"] == "cpu"
    assert shim["to_dtype"] == "torch.float64"  # non-device .to() calls are untouched


def test_tensor_type_reports_cuda_names_but_still_casts(shim):
    assert shim["type_str"] == "torch.cuda.FloatTensor"
    assert shim["type_cast_dtype"] == "torch.float64"


def test_rng_tracker_fork_gives_reproducible_separate_streams(shim):
    # fork() restores the default stream, and the tracked stream continues where it
    # left off: two forks of 4 draws equal 8 draws of a fresh seed-123 generator.
    assert shim["fork_restores_default"]
    assert shim["tracked_stream"] == shim["fresh_seed_123"]


def test_single_rank_bucket_collectives_skip_only_the_copy_onto_itself(shim):
    assert shim["bucket_funcs_wrapped"] == [True, True]
    assert shim["skipped_returned"] == [True, True]
    assert shim["bucket_after"] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]  # the sum over one rank: unchanged
    assert shim["separate_output"] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]  # a real all-gather into other memory


class _Group:
    def __init__(self, n):
        self.n = n

    def size(self):
        return self.n


def test_skip_single_rank_copy_calls_through_unless_nothing_moves():
    calls = []
    wrapped = skip_single_rank_copy(lambda out, inp, **kw: calls.append(kw) or "work")
    bucket = torch.zeros(8)
    assert wrapped(bucket[0:8], bucket, group=_Group(1), async_op=True) is None and calls == []
    # two ranks, a shard of half the bucket, another tensor, another dtype, no group: each is a real collective
    assert wrapped(bucket[0:8], bucket, group=_Group(2)) == "work"
    assert wrapped(bucket[0:4], bucket, group=_Group(1)) == "work"
    assert wrapped(torch.zeros(8), bucket, group=_Group(1)) == "work"
    assert wrapped(bucket.view(torch.int32), bucket, group=_Group(1)) == "work"
    assert wrapped(bucket, bucket) == "work"
    assert len(calls) == 5 and calls[0] == {"group": calls[0]["group"], "async_op": False}
