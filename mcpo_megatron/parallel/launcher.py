"""What the launcher (torchrun or srun) tells this process about itself: its rank, the world's size and its rank
on the node, read from the environment. The lowest piece of ``parallel/``: GPU binding and the process groups
both read it, and it imports nothing of the package."""

from __future__ import annotations

import os


def env_int(*names: str) -> int | None:
    """The first of ``names`` set in the environment, as an integer; None if none is set."""
    for name in names:
        value = os.environ.get(name)
        if value not in (None, ""):
            try:
                return int(value)
            except ValueError:
                raise ValueError(
                    f"environment variable {name}={value!r} must be an integer; "
                    "check the launcher (torchrun or srun) settings"
                ) from None
    return None


def launcher_env() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from torchrun or SLURM variables; (0, 1, 0) if neither.

    torchrun variables win when both are present (torchrun inside an allocation).
    Missing ``MASTER_ADDR``/``MASTER_PORT`` default to 127.0.0.1:29500 for a
    single-node run.
    """
    rank = env_int("RANK", "SLURM_PROCID")
    world = env_int("WORLD_SIZE", "SLURM_NTASKS")
    local = env_int("LOCAL_RANK", "SLURM_LOCALID")
    if rank is None and world is None:
        return 0, 1, 0
    if rank is None or world is None:
        raise ValueError(
            f"incomplete launcher environment: rank={rank}, world_size={world}; set both "
            "RANK and WORLD_SIZE (torchrun) or SLURM_PROCID and SLURM_NTASKS (srun)"
        )
    return rank, world, local if local is not None else 0
