"""The machine a benchmark ran on, for the line above its table: ratios between engines or kernels depend on
the CPU (and GPU), so a figure is quoted with it."""

from __future__ import annotations

import os
import platform


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux, else what ``platform`` knows)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def gpu_names() -> list[str]:
    """Names of the visible CUDA devices (none without CUDA or torch)."""
    try:
        import torch
    except ImportError:
        return []
    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def describe() -> str:
    """``machine: CPU <model> (<n> cores), GPU <name> x <count>`` (``GPU none`` without one)."""
    gpus = gpu_names()
    if gpus:
        gpu = ", ".join(f"{name} x {gpus.count(name)}" for name in dict.fromkeys(gpus))
    else:
        gpu = "none"
    return f"machine: CPU {cpu_model()} ({os.cpu_count()} cores), GPU {gpu}"
