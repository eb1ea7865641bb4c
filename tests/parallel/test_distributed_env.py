"""launcher_env / init_distributed argument checks (no process group is started)."""

import pytest

from mcpo_megatron.parallel.distributed import init_distributed
from mcpo_megatron.parallel.launcher import launcher_env

VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")


@pytest.fixture
def clean_env(monkeypatch):
    for v in VARS:
        monkeypatch.delenv(v, raising=False)
    return monkeypatch


def test_no_launcher_is_a_world_of_one(clean_env):
    assert launcher_env() == (0, 1, 0)


def test_torchrun_variables(clean_env):
    clean_env.setenv("RANK", "3")
    clean_env.setenv("WORLD_SIZE", "8")
    clean_env.setenv("LOCAL_RANK", "1")
    assert launcher_env() == (3, 8, 1)


def test_slurm_variables(clean_env):
    clean_env.setenv("SLURM_PROCID", "5")
    clean_env.setenv("SLURM_NTASKS", "16")
    clean_env.setenv("SLURM_LOCALID", "2")
    assert launcher_env() == (5, 16, 2)


def test_torchrun_wins_inside_an_allocation(clean_env):
    clean_env.setenv("SLURM_PROCID", "0")
    clean_env.setenv("SLURM_NTASKS", "1")
    clean_env.setenv("RANK", "1")
    clean_env.setenv("WORLD_SIZE", "2")
    assert launcher_env()[:2] == (1, 2)


def test_bad_environment_is_named(clean_env):
    clean_env.setenv("RANK", "x")
    clean_env.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="RANK='x'"):
        launcher_env()
    clean_env.delenv("WORLD_SIZE")
    clean_env.setenv("RANK", "0")
    with pytest.raises(ValueError, match="WORLD_SIZE"):
        launcher_env()


def test_layout_must_divide_world(clean_env):
    clean_env.setenv("RANK", "0")
    clean_env.setenv("WORLD_SIZE", "6")
    with pytest.raises(ValueError, match="not divisible by tp\\*pp\\*ep=4\\*1\\*1"):
        init_distributed(4, 1)
    with pytest.raises(ValueError, match="not divisible by tp\\*pp\\*ep=1\\*1\\*4"):
        init_distributed(1, 1, ep=4)
    with pytest.raises(ValueError, match="vpp=2"):
        init_distributed(2, 1, vpp=2)
    with pytest.raises(ValueError, match="tp=0"):
        init_distributed(0, 1)
    with pytest.raises(ValueError, match="backend='mpi'"):
        init_distributed(1, 1, backend="mpi")
