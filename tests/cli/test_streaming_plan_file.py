"""A saved streaming plan (plan.file) whose ``streaming`` section disagrees with the
experiment is refused where the run is prepared, before any worker starts, naming
plan.file (:func:`realign.run.streaming_check.check_streaming_plan`)."""
from __future__ import annotations

import json

import pytest

from realign.cli.main import main
from tests.cli.test_streaming_refused import GRPO, _exp

pytestmark = pytest.mark.pure


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stream-plan")
    cfg = json.loads(json.dumps(GRPO))
    cfg["plan"] = {"method": "exact", "seed": 0}
    out = tmp / "plan.json"
    assert main(["plan", _exp(tmp, cfg), "--out", str(out)]) == 0
    return cfg, json.loads(out.read_text())


@pytest.mark.parametrize("key, value", [("on_update", "finish"), ("max_staleness", 3),
                                        ("group_size", 2)])
def test_a_plan_file_streaming_otherwise_than_the_experiment_exits_2(
        saved, tmp_path, key, value):
    from planner.plan import ExecutionPlan
    from realign.errors import UserError
    from realign.run.loading import load_experiment
    from realign.run.streaming_check import check_streaming_plan

    cfg, raw = saved
    exp = load_experiment(_exp(tmp_path, json.loads(json.dumps(cfg))
                               | {"plan": {"file": "plan.json"}}))
    check_streaming_plan(exp, ExecutionPlan.from_json(json.dumps(raw)))   # as planned
    assert raw["streaming"][key] != value
    raw = json.loads(json.dumps(raw))
    raw["streaming"][key] = value
    if key == "group_size":                      # the rollout's sequences still match
        raw["streaming"]["batch_groups"] *= 2
        raw["streaming"]["capacity_groups"] *= 2
    with pytest.raises(UserError) as e:
        check_streaming_plan(exp, ExecutionPlan.from_json(json.dumps(raw)))
    assert e.value.field == "plan.file" and f"streaming.{key}" in str(e.value)
