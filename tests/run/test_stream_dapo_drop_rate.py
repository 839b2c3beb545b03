"""The drop rate a streamed DAPO run recorded (``stream.dropped_constant`` of the groups
it finished) prices the next plan's DAPO, as a step-by-step run's
``actor.dropped_group_frac`` does; a streamed run of another algorithm records none."""
from __future__ import annotations

import json

import pytest

from realign.run.lengths import recorded_drop_frac
from realign.run.loading import load_experiment
from realign.run.planning import dapo_drop_frac
from tests.run.conftest import experiment

pytestmark = pytest.mark.torch


def _recorded(tmp_path, rows):
    run = tmp_path / "before"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def test_a_streamed_dapo_runs_drops_price_the_next_plan(tiny_assets, tmp_path):
    dapo = {"actor.shortfall_frac": 0.0}
    run = _recorded(tmp_path, [
        {"step": 0, "stream.dropped_constant": 2.0, "stream.staleness_hist.0": 16.0, **dapo},
        {"step": 1, "stream.dropped_constant": 6.0, "stream.staleness_hist.0": 4.0,
         "stream.staleness_hist.1": 12.0, **dapo}])
    exp = experiment(tiny_assets, "tiny-dapo-cpu", tmp_path, rollout__mode="streaming",
                     algorithm__max_staleness=1, plan__lengths_from=str(run))
    cfg = load_experiment(exp)
    assert recorded_drop_frac(cfg) == pytest.approx(8 / 40)
    assert dapo_drop_frac(cfg, 0.45) == pytest.approx(0.2)
    exp = experiment(tiny_assets, "tiny-dapo-cpu", tmp_path, rollout__mode="streaming",
                     algorithm__max_staleness=1)
    assert dapo_drop_frac(load_experiment(exp), 0.45) == 0.45        # nothing recorded


def test_a_streamed_run_of_another_algorithm_records_no_drop_rate(tiny_assets, tmp_path):
    run = _recorded(tmp_path, [{"step": 0, "stream.dropped_constant": 0.0,
                                "stream.staleness_hist.0": 16.0}])
    exp = experiment(tiny_assets, "tiny-dapo-cpu", tmp_path, plan__lengths_from=str(run))
    assert recorded_drop_frac(load_experiment(exp)) is None
