"""CPU threads per process: the one rule every launcher of the project applies (imports nothing heavy, so the
nemo-run launcher can use it without torch)."""

from __future__ import annotations

import os


def threads_per_process(nproc: int) -> int:
    """An equal share of this machine's cores for each of ``nproc`` processes on it, at least 1."""
    return max(1, (os.cpu_count() or 1) // nproc)
