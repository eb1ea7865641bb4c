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
