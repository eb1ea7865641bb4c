"""vLLM's CUDA platform faked on CPU: a recording ``vllm.LLM`` and mocked CUDA devices, for the engine
arguments a command or an engine rank builds."""

from __future__ import annotations

import torch


class RecordingLLM:
    """Stands in for ``vllm.LLM``: records the engine arguments it is built with."""

    built: list[dict] = []

    def __init__(self, **kwargs):
        RecordingLLM.built.append(kwargs)
        self.llm_engine = self
        self.engine_core = self

    def shutdown(self):
        pass


def fake_cuda_vllm(monkeypatch, gpus: int = 8, gpu_memory_bytes: int = 80 * 1024**3):
    """vLLM's CUDA platform and ``gpus`` CUDA devices of ``gpu_memory_bytes``, with a recording ``vllm.LLM``. No
    launcher variables are set, as in a process started by hand, and those an engine sets for vLLM's external
    launcher are removed after the test."""
    import vllm

    from mcpo_megatron.rollout import vllm_engine

    RecordingLLM.built = []
    monkeypatch.setattr(vllm, "LLM", RecordingLLM)
    monkeypatch.setattr(vllm_engine, "vllm_device", lambda: "cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: type("Props", (), {"total_memory": gpu_memory_bytes})())
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.setenv(var, "")  # remembered, so that teardown restores the variable's state before the test
        monkeypatch.delenv(var)
    return RecordingLLM.built


