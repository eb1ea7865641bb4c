"""SLURM tests (this folder is on sys.path, so `import slurm_utils` works): they submit real jobs to a reachable cluster (CI starts one with local-slurm start.sh) and are
skipped, with the reason, when `sinfo` cannot reach one."""

import pytest

from slurm_utils import cluster


@pytest.fixture(scope="session")
def slurm():
    info = cluster()
    if info is None:
        pytest.skip(cluster.reason)
    return info


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """Overrides that point the CPU default at a tiny random Qwen3 with a character tokenizer (on a path the
    jobs can read: the local cluster runs on this machine)."""
    from slurm_utils import model_overrides
    from mcpo_megatron.models.tiny import make_tiny_model_with_tokenizer

    return model_overrides(make_tiny_model_with_tokenizer(tmp_path_factory.mktemp("tiny_model") / "model"))
