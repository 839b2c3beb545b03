"""`rollout.mode: streaming` and `rollout.on_update`: each unsupported combination
exits 2 naming its field, by `realign plan` and `realign run` alike, before any worker
starts; what `realign run` alone refuses (the streamed decode steps are not captured)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from realign.cli.main import main

pytestmark = pytest.mark.pure

GRPO = {
    "name": "stream-grpo",
    "models": {"actor": "tiny-llama"},
    "algorithm": {"name": "grpo", "prompts_per_step": 2, "samples_per_prompt": 4,
                  "prompt_len": 8, "gen_len": 64, "max_staleness": 2},
    "cluster": {"nodes": 1, "gpus_per_node": 2, "device": "cpu"},
    "device": "cpu",
    "rollout": {"mode": "streaming"},
}


def _with(path: str, value) -> dict:
    out = json.loads(json.dumps(GRPO))
    cur = out
    keys = path.split(".")
    for k in keys[:-1]:
        cur = cur.setdefault(k, {})
    cur[keys[-1]] = value
    return out


def _exp(tmp_path: Path, cfg: dict) -> str:
    p = tmp_path / "exp.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return str(p)


ONE = {"mesh": {"first_gpu": 0, "n_gpus": 1}, "layout": {"tp": 1, "pp": 1, "dp": 1}}
TWO = {"mesh": {"first_gpu": 0, "n_gpus": 2}, "layout": {"tp": 1, "pp": 1, "dp": 2}}


@pytest.mark.parametrize("cfg, field, needle", [
    (_with("algorithm.max_staleness", 0), "algorithm.max_staleness", "allowed: 1 or more"),
    (_with("rollout.engine", "vllm"), "rollout.engine", "allowed: own"),
    (_with("algorithm.name", "dapo") | {"algorithm": {
        **GRPO["algorithm"], "name": "dapo", "params": {"max_sampling_rounds": 2}}},
     "algorithm.params.max_sampling_rounds", "allowed: 1"),
    (_with("algorithm.name", "dapo") | {"models": {"actor": "tiny-llama",
                                                   "reward": "tiny-llama"}},
     "models.reward", "rule rewards only"),
    (_with("plan.manual", {"actor.generate": ONE, "actor.train": TWO}),
     "plan.manual.actor.generate.mesh", "disjoint"),
    (_with("rollout.mode", "step") | {"rollout": {"on_update": "finish"}},
     "rollout.on_update", "only with rollout.mode: streaming"),
])
@pytest.mark.parametrize("command", ["plan", "run"])
def test_streaming_combinations_exit_2_naming_the_field(tmp_path, capsys, cfg, field,
                                                        needle, command):
    rc = main([command, _exp(tmp_path, cfg)])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert field in err and needle in err and "Traceback" not in err
    assert not (tmp_path / "runs").exists()


def test_run_refuses_captured_streaming_decode_steps(tmp_path, capsys):
    """The streamed slots decode eagerly: rollout.capture on is refused before any worker
    starts (the placements a stream cannot run: tests/run/test_stream_run.py)."""
    rc = main(["run", _exp(tmp_path, _with("rollout.capture", "on"))])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "rollout.capture" in err and "eagerly" in err and "Traceback" not in err
    assert not (tmp_path / "runs").exists()


def test_bad_mode_value_names_the_allowed_ones(tmp_path, capsys):
    assert main(["plan", _exp(tmp_path, _with("rollout.mode", "stream"))]) == 2
    err = capsys.readouterr().err
    assert "rollout.mode" in err and "streaming" in err


def test_step_mode_still_plans(tmp_path, capsys):
    cfg = _with("rollout.mode", "step")
    cfg["plan"] = {"method": "exact", "seed": 0}
    assert main(["plan", _exp(tmp_path, cfg), "--out", str(tmp_path / "plan.json")]) == 0
