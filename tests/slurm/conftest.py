"""Session fixtures of the slurm tier: a one-node Slurm cluster in a temporary folder
(started once, torn down at the end), the tiny assets, and a private job index."""
from __future__ import annotations

import os

import pytest

from tests.run.conftest import tiny_assets  # noqa: F401  (fixture shared with tests/run)
from tests.slurm.cluster import LocalSlurm, install


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """SLURM_CONF and REALIGN_HOME point at the test cluster and index for the session."""
    reason = install()
    if reason:
        pytest.skip(reason)
    cluster = LocalSlurm()
    saved = {k: os.environ.get(k) for k in ("SLURM_CONF", "REALIGN_HOME")}
    try:
        cluster.start()
        os.environ.update(cluster.env, REALIGN_HOME=str(tmp_path_factory.mktemp("realign-home")))
        yield cluster
    finally:
        cluster.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
