"""The CUDA-side helpers of realign's vLLM engine (no vLLM needed): which GPU the
engine's child process is shown, and the share of it vLLM is told it may use."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.torch


def test_the_child_sees_only_the_workers_gpu():
    from realign.runtime.engines.vllm_engine import child_visible_devices

    assert child_visible_devices("4,5,6,7", 1) == "5"
    assert child_visible_devices(" 4, 5", 1) == "5"
    assert child_visible_devices(None, 3) == "3"
    assert child_visible_devices("", 0) == "0"


def test_vllms_memory_share_is_what_it_needs():
    from realign.runtime.engines.vllm_engine import GIB, cuda_memory_share

    assert cuda_memory_share(16 * GIB, 8 * GIB, 80 * GIB) == pytest.approx(26 / 80)
    assert cuda_memory_share(70 * GIB, 20 * GIB, 80 * GIB) == 0.95
