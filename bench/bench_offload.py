"""trainer.offload's transfer: the training state to host memory and back, against a plain copy of the same bytes.

The state of one GPU's share of a model is allocated on ``--device`` as megatron lays it out: one flat bf16
weight buffer, one flat fp32 gradient buffer, the fp32 master weights and two Adam moments of this rank's
optimizer shard (``--dp`` shards), ``--params`` parameters in all (default 3.69B: the 14B recipe's TP=4 rank).
:class:`~mcpo_megatron.models.offload.StorageOffload` then moves it as the trainer does: the weights and the
optimizer state copied into (pinned, on GPUs) host buffers, the gradients released without a copy, the device
storage freed and the allocator cache emptied; and back. Rows (best of ``--repeats``, after one warm-up that
allocates the host buffers):

* ``offload``: device -> host, the storages freed; GB/s of the bytes copied;
* ``onload``: host -> device, the storages allocated again, the gradients zeroed;
* ``plain copy to host`` / ``plain copy to device``: ``copy_`` of the same bytes between one preallocated device
  buffer and one preallocated host buffer of the same kind (pinned on GPUs), the baseline;
* ``x plain``: the row's GB/s over the plain copy's in the same direction.

"freed GB" is what the device's allocator gave back (``torch.cuda.memory_reserved`` before and after; on CPU the
bytes of the storages resized to 0). ``--json PATH`` also writes the figures.

    python bench/bench_offload.py                       # 3.69B parameters: ~38 GB of host memory on CPU
    python bench/bench_offload.py --params 2e8          # smaller
    python bench/bench_offload.py --device cuda          # a GPU (the GPU kit runs this)
"""

from __future__ import annotations

import argparse
import json
import time

from machine import describe


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", type=float, default=3.69e9, help="parameters on this GPU (default: 14B at TP=4)")
    p.add_argument("--dp", type=int, default=4, help="data-parallel shards of the optimizer state (default 4)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--repeats", type=int, default=3, help="measured round trips (best is reported)")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--json", default=None, help="also write the figures to this JSON file")
    args = p.parse_args(argv)
    for key in ("params", "dp", "repeats"):
        if not getattr(args, key) >= 1:
            p.error(f"--{key}={getattr(args, key)} must be >= 1")
    return args


def training_state(params: int, dp: int, device):
    """(copied, released) tensors: bf16 weights, fp32 master / exp_avg / exp_avg_sq shards; fp32 gradients."""
    import torch

    shard = -(-params // dp)
    copied = [torch.randn(params, device=device).to(torch.bfloat16)]
    copied += [torch.randn(shard, dtype=torch.float32, device=device) for _ in range(3)]
    released = [torch.zeros(params, dtype=torch.float32, device=device)]
    return copied, released


def best(repeats: int, fn) -> float:
    """The shortest wall seconds of ``repeats`` calls of ``fn``."""
    seconds = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        seconds = min(seconds, time.perf_counter() - t0)
    return seconds


def measure(args) -> dict:
    import torch

    from mcpo_megatron.models.offload import StorageOffload
    from mcpo_megatron.parallel.pinned import host_buffer

    torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    copied, released = training_state(int(args.params), args.dp, device)
    nbytes = sum(t.untyped_storage().nbytes() for t in copied)
    freed_bytes = nbytes + sum(t.untyped_storage().nbytes() for t in released)
    off = StorageOffload(device)
    off.offload(copied, released)  # warm-up: the host buffers are allocated (and pinned) once
    off.onload()

    def reserved():
        return torch.cuda.memory_reserved(device) if cuda else 0

    freed = []

    def offload():
        before = reserved()
        off.offload(copied, released)
        freed.append(before - reserved() if cuda else freed_bytes)

    offload_s = onload_s = float("inf")
    for _ in range(args.repeats):  # round trips: each onload restores what the offload before it moved
        t0 = time.perf_counter()
        offload()
        offload_s = min(offload_s, time.perf_counter() - t0)
        t0 = time.perf_counter()
        off.onload()
        onload_s = min(onload_s, time.perf_counter() - t0)

    # The baseline: the same bytes between one device buffer and one host buffer of the same kind.
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = host_buffer(nbytes, pinned=cuda, what="the baseline's host buffer")
    host.copy_(dev)

    def to_host():
        host.copy_(dev, non_blocking=cuda)
        sync()

    def to_device():
        dev.copy_(host, non_blocking=cuda)
        sync()

    to_host_s = best(args.repeats, to_host)
    to_device_s = best(args.repeats, to_device)
    gbps = lambda s: nbytes / s / 1e9  # noqa: E731
    rows = [
        {"path": "offload", "bytes": nbytes, "seconds": offload_s, "gbps": gbps(offload_s),
         "x_plain": to_host_s / offload_s},
        {"path": "onload", "bytes": nbytes, "seconds": onload_s, "gbps": gbps(onload_s),
         "x_plain": to_device_s / onload_s},
        {"path": "plain copy to host", "bytes": nbytes, "seconds": to_host_s, "gbps": gbps(to_host_s), "x_plain": 1.0},
        {"path": "plain copy to device", "bytes": nbytes, "seconds": to_device_s, "gbps": gbps(to_device_s),
         "x_plain": 1.0},
    ]
    return {"device": str(device), "params": int(args.params), "dp": args.dp, "copied_bytes": nbytes,
            "released_bytes": freed_bytes - nbytes, "freed_bytes": min(freed), "pinned": cuda,
            "offload_gbps": rows[0]["gbps"], "onload_gbps": rows[1]["gbps"], "rows": rows}


def format_table(res: dict) -> str:
    lines = [describe(),
             f"{res['params'] / 1e9:.2f}B parameters on {res['device']}: bf16 weights + fp32 master, m, v over DP="
             f"{res['dp']} = {res['copied_bytes'] / 1e9:.2f} GB copied, {res['released_bytes'] / 1e9:.2f} GB of fp32 "
             f"gradients released; freed {res['freed_bytes'] / 1e9:.2f} GB on the device; host buffers "
             + ("pinned" if res["pinned"] else "plain"),
             f"{'path':<22}  {'GB':>8}  {'seconds':>8}  {'GB/s':>8}  {'x plain':>8}",
             "-" * 62]
    for r in res["rows"]:
        lines.append(f"{r['path']:<22}  {r['bytes'] / 1e9:8.3f}  {r['seconds']:8.4f}  {r['gbps']:8.2f}  "
                     f"{r['x_plain']:8.2f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    res = measure(args)
    print(format_table(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
