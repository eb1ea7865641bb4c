"""The CPU shim, applied in a separate process (it patches torch process-wide)."""

from pathlib import Path

import pytest
import torch

from mp import run_json_worker

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
