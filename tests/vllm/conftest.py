"""The vllm tier's fixtures: the run tests' tiny assets (their small actor has heads of
32 channels, the least vLLM's CPU kernels take), and a one-rank gloo world in the test's
process for the files that drive an engine directly (vLLM's engine core runs in its
child process)."""
from __future__ import annotations

import pytest

from tests.run.conftest import tiny_assets  # noqa: F401  (a fixture, used by name)


@pytest.fixture(scope="module")
def world():
    """A one-rank gloo world for one test file, destroyed after it."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
