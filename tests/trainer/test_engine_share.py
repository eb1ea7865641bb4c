"""A colocated vLLM engine's share of its GPU when rollout.gpu_memory_utilization is null: the trainer applies
mcpo plan's rule to the GPU it runs on (CUDA mocked: an 80 GiB device), so the 14B recipe's engine takes what
trainer.offload leaves free; a set value is the engine's own, and on CPU vLLM sizes its KV cache itself."""

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import torch

from mcpo_megatron.config import load_config
from mcpo_megatron.parallel.distributed import ParallelInfo
from mcpo_megatron.trainer import components

REPO = Path(__file__).resolve().parents[2]
GIB = 2**30
INFO = ParallelInfo(rank=0, world_size=16, local_rank=0, tp=4, pp=1, dp=4, tp_rank=0, pp_rank=0, dp_rank=0,
                    is_first_stage=True, is_last_stage=True, tp_group=None, pp_group=None, dp_group=None,
                    device=torch.device("cuda", 0))


def test_null_share_is_the_plans_for_this_gpu(monkeypatch):
    seen = []

    def properties(device):
        seen.append(device)
        return SimpleNamespace(total_memory=80 * GIB)

    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    recipe = str(REPO / "configs/qwen3_14b_mcpo.yaml")
    assert components.colocated_engine_share(load_config(recipe), INFO) == 0.96  # (80 - 3 reserve) / 80
    assert seen == [torch.device("cuda", 0)]
    resident = load_config(recipe, ["trainer.offload.enable=false"])
    assert components.colocated_engine_share(resident, INFO) == 0.6  # the default beside the resident state
    assert components.colocated_engine_share(load_config(recipe, ["rollout.gpu_memory_utilization=0.5"]),
                                             INFO) is None  # set: from_config takes it as it is
    cpu = dataclasses.replace(INFO, device=torch.device("cpu"))
    assert components.colocated_engine_share(load_config(recipe), cpu) is None
