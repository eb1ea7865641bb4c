"""Collectives work on every backend by construction.

On a CUDA machine NCCL has no path for CPU tensors, and the package hands CPU tensors (flags, counters, metric
sums) to collectives every step. So: the default group must be started with a backend for CPU tensors too (checked
with CUDA mocked), and every collective call of the package must go through ``parallel/distributed.py``, whose
helpers run a tensor on a device its group has a backend for (checked by reading the package).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from mcpo_megatron.parallel import distributed as D

PACKAGE = Path(D.__file__).resolve().parents[1]
# The one module that calls torch.distributed's collectives, and the CPU shim (its stand-ins replace megatron-core's
# own uneven all-gather / reduce-scatter on gloo, CPU machines only).
ALLOWED = {PACKAGE / "parallel" / "distributed.py", PACKAGE / "parallel" / "cpu_shim.py"}
COLLECTIVES = {
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast", "broadcast_object_list",
    "reduce", "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "barrier", "send", "recv",
    "isend", "irecv", "batch_isend_irecv", "gather", "scatter", "gather_object", "scatter_object_list",
    "monitored_barrier",
}


def collective_calls(path: Path) -> list[str]:
    """``file:line name`` of every torch.distributed collective called (or imported by name) in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    where = path.relative_to(PACKAGE.parent) if path.is_relative_to(PACKAGE.parent) else path.name
    aliases = set()  # names bound to the torch.distributed module
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch.distributed" and a.asname:
                    aliases.add(a.asname)
        elif isinstance(node, ast.ImportFrom):
            if node.module == "torch" and any(a.name == "distributed" for a in node.names):
                aliases.update(a.asname or a.name for a in node.names if a.name == "distributed")
            if node.module == "torch.distributed":
                found += [f"{where}:{node.lineno} {a.name}" for a in node.names if a.name in COLLECTIVES]

    def is_dist(value) -> bool:
        if isinstance(value, ast.Name):
            return value.id in aliases
        return (isinstance(value, ast.Attribute) and value.attr == "distributed"
                and isinstance(value.value, ast.Name) and value.value.id == "torch")

    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in COLLECTIVES:
            if is_dist(node.func.value):
                found.append(f"{where}:{node.lineno} {node.func.attr}")
    return found


def test_every_collective_goes_through_parallel_distributed():
    offenders = [c for p in sorted(PACKAGE.rglob("*.py")) if p not in ALLOWED for c in collective_calls(p)]
    assert not offenders, ("call torch.distributed collectives through mcpo_megatron.parallel.distributed (all_reduce, "
                           "broadcast, all_gather, ...), which run on a device the group has a backend for:\n  "
                           + "\n  ".join(offenders))


def test_the_scan_finds_direct_calls(tmp_path):
    """The reader itself: each way of calling a collective directly is found."""
    src = tmp_path / "m.py"
    src.write_text("import torch\nimport torch.distributed as dist\nfrom torch import distributed as d2\n"
                   "from torch.distributed import all_gather\n"
                   "dist.all_reduce(x)\ntorch.distributed.broadcast(x, 0)\nd2.barrier()\ndist.get_rank()\n")
    names = sorted(c.split()[-1] for c in collective_calls(src))
    assert names == ["all_gather", "all_reduce", "barrier", "broadcast"]


def test_default_backend_gives_cpu_tensors_a_backend_on_cuda_machines(monkeypatch):
    """With CUDA (mocked), the default group is started with gloo for CPU tensors beside NCCL, and the CPU shim
    stays off; without CUDA it is plain gloo."""
    calls = {}

    class Started(Exception):
        pass

    def init_process_group(**kwargs):
        calls.update(kwargs)
        raise Started

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_PORT", "29999")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    monkeypatch.setattr(D, "apply_cpu_shim", lambda: pytest.fail("the CPU shim must stay off on a CUDA machine"))
    with pytest.raises(Started):
        D.init_distributed(1, 1)
    backend = calls["backend"]
    per_device = dict(pair.split(":") for pair in backend.split(",")) if ":" in backend else {}
    assert per_device == {"cpu": "gloo", "cuda": "nccl"}, backend


def test_backend_maps():
    assert D.default_backend(True) == "cpu:gloo,cuda:nccl" and D.default_backend(False) == "gloo"
    assert D.backend_device_types("cpu:gloo,cuda:nccl") == {"cpu", "cuda"}
    assert D.backend_device_types("nccl") == {"cuda"}
    assert D.backend_device_types("gloo") == {"cpu", "cuda"}  # gloo copies CUDA tensors through the host
    assert D.backend_device_types("no-such") == frozenset()
    assert D.backend_for_device("nccl", "cpu") is None


def test_comm_device(monkeypatch):
    """A tensor runs on its own device when the group has a backend for it, else on the group's."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    cpu, cuda0 = torch.device("cpu"), torch.device("cuda", 0)
    assert D.comm_device(cpu, frozenset({"cpu", "cuda"})) == cpu
    assert D.comm_device(cuda0, frozenset({"cpu", "cuda"})) == cuda0
    assert D.comm_device(cpu, frozenset({"cuda"})) == torch.device("cuda", 3)  # an NCCL-only group
    assert D.comm_device(cuda0, frozenset({"cpu"})) == cpu
    with pytest.raises(RuntimeError, match="no communication backend for cpu"):
        D.comm_device(cpu, frozenset())


def test_helper_stages_a_tensor_through_the_groups_device(monkeypatch):
    """A group without a backend for the tensor's device gets a copy on its own device; the result comes back.
    (The CPU's own device plays the tensor's; the meta device plays a GPU the group is limited to.)"""
    t = torch.ones(3)
    seen = []
    monkeypatch.setattr(D, "_group_device_types", lambda group: frozenset({"cpu"}))
    D._on_comm_device(t, None, lambda x: (seen.append(x.data_ptr()), x.mul_(2)))
    assert seen == [t.data_ptr()] and t.tolist() == [2.0, 2.0, 2.0]  # its own device: in place, no copy

    monkeypatch.setattr(D, "_group_device_types", lambda group: frozenset({"meta"}))
    monkeypatch.setattr(D, "comm_device", lambda device, types: torch.device("meta"))
    calls = []
    monkeypatch.setattr(torch.Tensor, "copy_", lambda self, src: calls.append(("copy back", src.device.type)))
    D._on_comm_device(t, None, lambda x: calls.append(("collective", x.device.type)))
    assert calls == [("collective", "meta"), ("copy back", "meta")]
