"""The vllm tier's fixtures: the run tests' tiny assets (their small actor has heads of
32 channels, the least vLLM's CPU kernels take)."""
from __future__ import annotations

from tests.run.conftest import tiny_assets  # noqa: F401  (a fixture, used by name)
