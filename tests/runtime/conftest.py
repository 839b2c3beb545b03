"""Fixtures of the runtime tests: tiny random HF checkpoints and one 2-rank gloo world
shared by every multi-process test of this folder (start-up costs ~10 s)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))


LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8}


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
        # LLaMA 3.1's rope scaling with an original window of 8 positions, so the tests'
        # 12-token prompts run past it (as 128k-token prompts do past 8192)
        "llama31": str(make_tiny(root / "llama31", "llama", seed=5, rope_parameters=dict(
            LLAMA31_ROPE, rope_theta=500000.0))),
        "llama_yarn": str(make_tiny(root / "llama_yarn", "llama", seed=6, rope_parameters={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
            "rope_theta": 10000.0})),
        "llama_linear": str(make_tiny(root / "llama_linear", "llama", seed=7, rope_parameters={
            "rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})),
        # Qwen3: q/k norms, head_dim 32 where hidden / heads is 16, tied embeddings
        "qwen3": str(make_tiny(root / "qwen3", "qwen3", tied=True, seed=8, head_dim=32)),
        "qwen3_rm": str(make_tiny(root / "qwen3_rm", "qwen3", head="value", seed=9,
                                  head_dim=32)),
    }


@pytest.fixture(scope="session")
def world2():
    from realign.runtime.local_world import LocalWorld

    with LocalWorld(2, timeout_s=180) as w:
        yield w
