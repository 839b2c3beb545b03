"""Session fixtures of the ray tier: a local Ray head with the job API (started once,
torn down at the end), the tiny assets, and a private job index."""
from __future__ import annotations

import os

import pytest

from tests.ray.head import LocalRayHead
from tests.run.conftest import tiny_assets  # noqa: F401  (fixture shared with tests/run)


@pytest.fixture(scope="session")
def ray_head(tmp_path_factory):
    """REALIGN_HOME points at a private job index for the session."""
    head = LocalRayHead(num_cpus=4)
    saved = {k: os.environ.get(k) for k in ("REALIGN_HOME", "RAY_ADDRESS")}
    try:
        head.start()
        os.environ["REALIGN_HOME"] = str(tmp_path_factory.mktemp("realign-home"))
        os.environ.pop("RAY_ADDRESS", None)
        yield head
    finally:
        head.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
