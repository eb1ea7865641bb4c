"""Worker (plain subprocess): apply the CPU shim and report what megatron-style calls now do.

Usage: worker_cpu_shim.py OUT_JSON.  Runs in its own process because the shim
patches torch process-wide and must not leak into the pytest process.
"""

import json
import sys

import torch

from mcpo_megatron.parallel.cpu_shim import apply_cpu_shim


def main() -> None:
    out = {"first": apply_cpu_shim(), "second": apply_cpu_shim()}
    out["current_device"] = str(torch.cuda.current_device())
    out["zeros_device"] = str(torch.zeros(3, device="cuda").device)
    out["tensor_cuda_device"] = str(torch.tensor([1.0], device="cuda").cuda().device)
    out["to_cuda_device"] = str(torch.ones(2).to("cuda").device)
    out["int_device"] = str(torch.empty(2, device=0).to(0).device)
    out["to_dtype"] = str(torch.ones(2).to(torch.float64).dtype)
    out["type_str"] = torch.ones(2).type()
    out["type_cast_dtype"] = str(torch.ones(2).type(torch.float64).dtype)
    torch.cuda.synchronize()

    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    tracker = CudaRNGStatesTracker()
    torch.manual_seed(0)
    tracker.add("tp", 123)
    outside_before = torch.get_rng_state()
    with tracker.fork("tp"):
        a = torch.rand(4)
    out["fork_restores_default"] = bool(torch.equal(torch.get_rng_state(), outside_before))
    with tracker.fork("tp"):
        b = torch.rand(4)
    out["tracked_stream"] = torch.cat([a, b]).tolist()
    out["fresh_seed_123"] = torch.rand(8, generator=torch.Generator().manual_seed(123)).tolist()
    with open(sys.argv[1], "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
