"""Hyper-parameters that contradict each other stop ``realign run`` with exit code 2
before any worker starts, naming both with their values and what is allowed (every
pair: tests/algorithms/test_contradicting_params.py)."""
from __future__ import annotations

import pytest

from tests.run.test_run_inputs import bad

pytestmark = pytest.mark.pure


def test_swapped_dapo_bounds_exit_2_before_any_worker(tiny_assets, tmp_path):
    err = bad(tiny_assets, tmp_path, "tiny-dapo-cpu",
              algorithm__params={"clip_ratio": 0.28, "clip_ratio_high": 0.2})
    assert ("algorithm.params.clip_ratio_high: 0.2 contradicts algorithm.params.clip_ratio "
            "0.28; allowed: clip_ratio_high >= clip_ratio") in err
    assert "[0.72, 1.2]" in err


def test_a_round_cap_without_rounds_exits_2_before_any_worker(tiny_assets, tmp_path):
    err = bad(tiny_assets, tmp_path, "tiny-dapo-cpu",
              algorithm__params={"max_round_prompts": 60})
    assert ("algorithm.params.max_round_prompts: 60 contradicts "
            "algorithm.params.max_sampling_rounds 1; allowed:") in err
    err = bad(tiny_assets, tmp_path / "b", "tiny-dapo-cpu",
              algorithm__params={"max_sampling_rounds": 4, "max_round_prompts": 0})
    assert "algorithm.params.max_round_prompts" in err
