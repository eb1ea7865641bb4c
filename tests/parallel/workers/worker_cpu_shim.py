"""Worker (plain subprocess): apply the CPU shim and report what megatron-style calls now do.

Usage: worker_cpu_shim.py OUT_JSON.  Runs in its own process because the shim
patches torch process-wide and must not leak into the pytest process.
"""

import json
import sys

import torch

from mcpo_megatron.parallel.cpu_shim import apply_cpu_shim


def single_rank_bucket_collectives(store: str) -> dict:
    """megatron's DDP-bucket collectives on a group of one rank, as its distributed optimizer calls them: the
    shard is the whole bucket (skipped, inside an async coalescing manager); a separate output still gets a copy."""
    import torch.distributed as dist
    from megatron.core.distributed import param_and_grad_buffer as buckets
    from torch.distributed import _coalescing_manager

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    group = dist.new_group([0])
    bucket = torch.arange(6, dtype=torch.float32)
    shard = bucket[0:6]
    with _coalescing_manager(group, async_ops=True) as cm:
        returned = [buckets.dist_reduce_scatter_func(shard, bucket, op=dist.ReduceOp.SUM, group=group, async_op=True),
                    buckets.dist_all_gather_func(bucket, shard, group=group, async_op=True)]
    cm.wait()
    separate = torch.full((6,), -1.0)
    buckets.dist_all_gather_func(separate, bucket, group=group)
    return {"bucket_funcs_wrapped": [getattr(f, "_mcpo_cpu_shim", False) for f in
                                     (buckets.dist_reduce_scatter_func, buckets.dist_all_gather_func)],
            "skipped_returned": [r is None for r in returned], "bucket_after": bucket.tolist(),
            "separate_output": separate.tolist()}


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
    out.update(single_rank_bucket_collectives(sys.argv[1] + ".store"))
    with open(sys.argv[1], "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
