"""Fixtures of the runtime tests: tiny random HF checkpoints and one 2-rank gloo world
shared by every multi-process test of this folder (start-up costs ~10 s)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    from tiny_hf import make_tiny

    root = tmp_path_factory.mktemp("hf")
    return {
        "llama": str(make_tiny(root / "llama", "llama")),
        "llama_tied": str(make_tiny(root / "llama_tied", "llama", tied=True, seed=1)),
        "qwen2": str(make_tiny(root / "qwen2", "qwen2", seed=2)),
        "mistral": str(make_tiny(root / "mistral", "mistral", seed=3, sliding_window=64)),
        "llama_rm": str(make_tiny(root / "llama_rm", "llama", head="value", seed=4)),
    }


@pytest.fixture(scope="session")
def world2():
    from realign.runtime.local_world import LocalWorld

    with LocalWorld(2, timeout_s=180) as w:
        yield w
