"""The rule that picks a rank's CUDA device (parallel/gpu_binding.py), and its users: init_distributed, the engine
ranks of separate placement and the LOCAL_RANK that vLLM's external launcher reads. CUDA is mocked."""

from __future__ import annotations

import os

import pytest
import torch

from mcpo_megatron.parallel import distributed as D
from mcpo_megatron.parallel.gpu_binding import (
    cuda_device_index,
    local_world_size_from_env,
    slurm_tasks_on_this_node,
    this_rank_cuda_index,
)

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS",
                 "SLURM_LOCALID", "SLURM_NODEID", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE",
                 "SLURM_STEP_TASKS_PER_NODE", "CUDA_VISIBLE_DEVICES", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def env(monkeypatch):
    for name in LAUNCHER_VARS:
        monkeypatch.setenv(name, "")  # remembered, so that teardown also removes what the code under test sets
        monkeypatch.delenv(name)
    return monkeypatch


def srun_task(env, *, local_rank: int, tasks_per_node: int, visible: str | None, nodes: int = 1, node: int = 0):
    """The variables srun gives one task (``--ntasks-per-node=tasks_per_node``); ``visible``: its binding."""
    env.setenv("SLURM_PROCID", str(node * tasks_per_node + local_rank))
    env.setenv("SLURM_NTASKS", str(nodes * tasks_per_node))
    env.setenv("SLURM_LOCALID", str(local_rank))
    env.setenv("SLURM_NODEID", str(node))
    env.setenv("SLURM_NTASKS_PER_NODE", str(tasks_per_node))
    env.setenv("SLURM_STEP_TASKS_PER_NODE", f"{tasks_per_node}(x{nodes})")
    if visible is not None:
        env.setenv("CUDA_VISIBLE_DEVICES", visible)


def torchrun_proc(env, *, local_rank: int, nproc: int, visible: str | None = None):
    env.setenv("RANK", str(local_rank))
    env.setenv("WORLD_SIZE", str(nproc))
    env.setenv("LOCAL_RANK", str(local_rank))
    env.setenv("LOCAL_WORLD_SIZE", str(nproc))
    if visible is not None:
        env.setenv("CUDA_VISIBLE_DEVICES", visible)


class FakeCuda:
    """torch.cuda with ``count`` devices; records set_device."""

    def __init__(self, monkeypatch, count: int):
        self.current = 0
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "set_device", self.set_device)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)

    def set_device(self, device):
        index = device.index if isinstance(device, torch.device) else int(device)
        assert index is not None
        self.current = index


# ------------------------------------------------------------------------------------------------ the rule
@pytest.mark.parametrize("local_rank, ranks, devices, visible, torchrun, index", [
    (5, 8, 8, None, False, 5),            # srun, every GPU of the node visible, no binding
    (5, 8, 8, "0,1,2,3,4,5,6,7", False, 5),  # the same with SLURM's CUDA_VISIBLE_DEVICES of the job's GPUs
    (3, 4, 8, None, True, 3),             # torchrun, fewer processes than GPUs
    (5, 8, 1, "5", False, 0),             # srun --gpus-per-task=1: the task's one GPU
    (5, None, 1, "5", False, 0),          # ... with the tasks per node unknown
    (5, 8, 4, "4,5,6,7", False, 1),       # 4 GPUs shared by 4 consecutive tasks (binding to the close GPUs)
    (1, 4, 2, "2,3", False, 1),           # srun --gpus-per-task=2 with 4 tasks: each task its own pair
    (1, 2, 2, "2,3", True, 1),            # torchrun with 2 processes inside a task bound to 2 GPUs
    (0, 1, 1, None, False, 0),            # one process, one GPU
])
def test_the_rule_places_every_supported_layout(local_rank, ranks, devices, visible, torchrun, index):
    assert cuda_device_index(local_rank, ranks, devices, visible, torchrun=torchrun) == index


@pytest.mark.parametrize("local_rank, ranks, devices, visible, torchrun, message", [
    (4, 8, 4, None, False, r"the node runs 8 ranks and this process sees 4 CUDA device\(s\) "
                           r"\(CUDA_VISIBLE_DEVICES=None\); CUDA_VISIBLE_DEVICES is not set.*at most 4 ranks"),
    (1, 2, 1, "3", True, r"torchrun's processes share one CUDA_VISIBLE_DEVICES"),
    (5, 8, 3, "0,1,2", False, r"a binding of 3 GPUs per task places 8 ranks only when 3 divides"),
    (5, None, 2, "0,1", False, r"unknown number of ranks.*set LOCAL_WORLD_SIZE or SLURM_NTASKS_PER_NODE"),
    (0, 1, 0, "", False, r"sees no CUDA device"),
    (8, 8, 8, None, False, r"local rank 8 is outside the node's 8 ranks"),
])
def test_an_impossible_layout_is_refused_naming_the_numbers(local_rank, ranks, devices, visible, torchrun,
                                                            message):
    with pytest.raises((RuntimeError, ValueError), match=message):
        cuda_device_index(local_rank, ranks, devices, visible, torchrun=torchrun)


def test_slurm_tasks_per_node_lists():
    assert slurm_tasks_on_this_node("4(x2),3", 2) == 3 and slurm_tasks_on_this_node("4(x2),3", 1) == 4
    assert slurm_tasks_on_this_node("8(x16)", None) == 8
    assert slurm_tasks_on_this_node("4,3", None) is None and slurm_tasks_on_this_node("garbage", 0) is None


def test_local_world_size_from_the_launchers(env):
    assert local_world_size_from_env() is None
    env.setenv("SLURM_NTASKS_PER_NODE", "8")
    assert local_world_size_from_env() == 8
    env.setenv("SLURM_TASKS_PER_NODE", "4(x2),2")  # the step's own list wins over --ntasks-per-node
    env.setenv("SLURM_NODEID", "2")
    assert local_world_size_from_env() == 2
    env.setenv("LOCAL_WORLD_SIZE", "3")  # torchrun's
    assert local_world_size_from_env() == 3


def test_this_rank_reads_srun_and_torchrun(env):
    srun_task(env, local_rank=3, tasks_per_node=4, visible="3", nodes=2, node=1)
    assert this_rank_cuda_index(device_count=1) == 0
    for name in LAUNCHER_VARS:
        env.delenv(name, raising=False)
    torchrun_proc(env, local_rank=1, nproc=2, visible="5")  # torchrun in a task bound to one GPU: both share it
    with pytest.raises(RuntimeError, match="torchrun's processes share one CUDA_VISIBLE_DEVICES"):
        this_rank_cuda_index(device_count=1)


# ------------------------------------------------------------------------------------------------ its users
class Started(Exception):
    pass


def start_trainer_rank(monkeypatch) -> None:
    """init_distributed up to the process group (which this raises instead of starting)."""
    def init_process_group(**kwargs):
        raise Started

    monkeypatch.setattr(D.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(D.dist, "init_process_group", init_process_group)
    with pytest.raises(Started):
        D.init_distributed(1, 1)


def start_engine_rank(monkeypatch) -> None:
    from mcpo_megatron.parallel.bridge import ROLLOUT, Roles
    from mcpo_megatron.trainer.rollout_worker import EngineRank

    EngineRank(Roles(ROLLOUT, 0, 1, 1, 2, 1))


@pytest.mark.parametrize("start", [start_trainer_rank, start_engine_rank], ids=["trainer", "engine"])
def test_ranks_refuse_to_share_a_gpu_without_a_binding(env, start):
    """8 tasks on a node whose 4 GPUs every task sees: local rank 5 would share GPU 1 with local rank 1."""
    srun_task(env, local_rank=5, tasks_per_node=8, visible=None)
    FakeCuda(env, 4)
    with pytest.raises(RuntimeError, match="cannot give local rank 5 a GPU of its own: the node runs 8 ranks"):
        start(env)


@pytest.mark.parametrize("start", [start_trainer_rank, start_engine_rank], ids=["trainer", "engine"])
def test_ranks_take_the_gpu_the_rule_chose(env, start):
    srun_task(env, local_rank=6, tasks_per_node=8, visible="4,5,6,7")  # 4 close GPUs for tasks 4..7
    cuda = FakeCuda(env, 4)
    start(env)
    assert cuda.current == 2


def test_vllm_reads_the_chosen_index_as_local_rank(env):
    """vLLM's external launcher takes LOCAL_RANK as the CUDA index (asserting it is below the device count): under
    srun --gpus-per-task=1 local rank 3 sees one GPU, which is index 0."""
    from mcpo_megatron.rollout.engines.vllm.engine import _launcher_env_for_vllm

    srun_task(env, local_rank=3, tasks_per_node=4, visible="3")
    FakeCuda(env, 1)
    _launcher_env_for_vllm()
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == ("3", "4", "0")
    _launcher_env_for_vllm()  # again (a second engine in the process): the same index
    assert os.environ["LOCAL_RANK"] == "0"


def test_vllm_env_of_a_process_started_without_a_launcher(env):
    """A GPU process started by hand is a world of one: RANK, WORLD_SIZE and LOCAL_RANK for vLLM (the CUDA index
    was read after RANK was set, when the launcher's environment looked incomplete: rank 0, no world size)."""
    from mcpo_megatron.rollout.engines.vllm.engine import _launcher_env_for_vllm

    FakeCuda(env, 2)
    _launcher_env_for_vllm()
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == ("0", "1", "0")
    assert int(os.environ["MASTER_PORT"]) > 0
