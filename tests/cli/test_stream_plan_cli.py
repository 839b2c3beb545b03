"""`realign plan` of a `rollout.mode: streaming` experiment: the three modes side by
side, the fastest kept, plan.json carrying the stream and plan.svg its two sides."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from planner.plan import ExecutionPlan
from realign.cli.main import main

pytestmark = pytest.mark.pure

#: a long tail: responses of 40 tokens on average, capped at 256
TAIL = {
    "name": "stream-tail",
    "models": {"actor": "tiny-llama"},
    "algorithm": {"name": "grpo", "prompts_per_step": 8, "samples_per_prompt": 4,
                  "prompt_len": 8, "gen_len": 256, "gen_len_mean": 40, "max_staleness": 2},
    "cluster": {"nodes": 1, "gpus_per_node": 2, "device": "cpu"},
    "device": "cpu",
    "rollout": {"mode": "streaming"},
    "plan": {"method": "exact", "seed": 0, "time_limit_s": 60},
}


def test_plan_prints_the_three_modes_and_writes_the_stream(tmp_path: Path, capsys):
    exp = tmp_path / "exp.yaml"
    exp.write_text(yaml.safe_dump(TAIL))
    out = tmp_path / "plan.json"
    assert main(["plan", str(exp), "--out", str(out), "--timeline",
                 str(tmp_path / "plan.svg")]) == 0
    text = capsys.readouterr().out
    assert "synchronous vs asynchronous vs streaming" in text
    for row in ("iteration s", "split gen+train GPUs", "staleness mean", "gen idle",
                "train idle"):
        assert row in text
    plan = ExecutionPlan.load(out)
    modes = {m.mode: m for m in plan.modes}
    assert list(modes) == ["synchronous", "asynchronous", "streaming"]
    fastest = min(modes.values(), key=lambda m: m.iteration_time_s or float("inf"))
    assert fastest.chosen and plan.iteration_time_s == fastest.iteration_time_s
    assert fastest.mode == "streaming" and plan.streaming is not None      # the long tail
    assert json.loads(out.read_text())["streaming"]["max_staleness"] <= 2
    assert "per step streaming" in (tmp_path / "plan.svg").read_text()

