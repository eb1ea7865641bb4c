"""The CPU shim in a single process (CUDA is absent on CI machines)."""

import pytest
import torch

from mcpo_megatron.parallel.cpu_shim import apply_cpu_shim

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the shim is a no-op with CUDA")


def test_idempotent_and_redirects_cuda_to_cpu():
    assert apply_cpu_shim() is True
    assert apply_cpu_shim() is True
    assert torch.cuda.current_device() == torch.device("cpu")
    t = torch.zeros(3, device="cuda")
    assert t.device.type == "cpu"
    assert torch.tensor([1.0], device="cuda").cuda().device.type == "cpu"
    assert torch.ones(2).to("cuda").device.type == "cpu"
    assert torch.ones(2).type() == "torch.cuda.FloatTensor"
    assert torch.ones(2).type(torch.float64).dtype == torch.float64
    torch.cuda.synchronize()


def test_rng_tracker_fork_gives_reproducible_separate_streams():
    apply_cpu_shim()
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    tracker = CudaRNGStatesTracker()
    torch.manual_seed(0)
    tracker.add("tp", 123)
    outside_before = torch.get_rng_state()
    with tracker.fork("tp"):
        a = torch.rand(4)
    # fork restores the default stream ...
    assert torch.equal(torch.get_rng_state(), outside_before)
    # ... and the tracked stream continues where it left off and equals a fresh seed-123 stream.
    with tracker.fork("tp"):
        b = torch.rand(4)
    ref = torch.Generator().manual_seed(123)
    assert torch.equal(torch.cat([a, b]), torch.rand(8, generator=ref))
