"""The planner's episode shape from the YAML, or measured by a previous run
(``plan.lengths_from``): turns, tokens per observation, environment seconds."""
from __future__ import annotations

import json

import pytest
import yaml

from realign.run.loading import load_experiment
from realign.run.planning import turns_shape

pytestmark = pytest.mark.torch


def _cfg(tmp_path, rollout: dict, plan: dict | None = None):
    y = {"name": "t", "models": {"actor": "tiny-llama"},
         "algorithm": {"name": "grpo", "prompts_per_step": 4, "samples_per_prompt": 2,
                       "prompt_len": 8, "gen_len": 48, "ppo_minibatches": 1},
         "rollout": rollout, "plan": plan or {}}
    p = tmp_path / "e.yaml"
    p.write_text(yaml.safe_dump(y))
    return load_experiment(p)


def test_the_yaml_gives_the_shape(tmp_path):
    cfg = _cfg(tmp_path, {"tools": ["m:f"], "max_turns": 3, "turn_tokens": 12,
                           "plan_turns": 2.5, "plan_observation_tokens": 5,
                           "plan_env_s": 0.2, "env_groups": 4})
    t = turns_shape(cfg)
    assert (t.turns, t.turn_tokens, t.obs_tokens, t.env_s, t.groups) == (2.5, 12, 5, 0.2, 4)
    cfg = _cfg(tmp_path, {"tools": ["m:f"]})
    t = turns_shape(cfg)                  # defaults: max_turns, the whole budget
    assert (t.turns, t.turn_tokens, t.obs_tokens, t.env_s, t.groups) == (4, 48, 64, 0.0, 2)
    cfg = _cfg(tmp_path, {})
    assert turns_shape(cfg) is None


def test_a_previous_run_gives_what_the_yaml_leaves_unset(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": 0, "rollout.turns": 1.5, "rollout.masked_share": 0.2,
             "response_len": 30.0, "rollout.env_s_per_call": 0.1},
            {"step": 1, "rollout.turns": 2.5, "rollout.masked_share": 0.3,
             "response_len": 40.0, "rollout.env_s_per_call": 0.3}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = _cfg(tmp_path, {"tools": ["m:f"], "max_turns": 3},
                {"lengths_from": str(run)})
    t = turns_shape(cfg)
    # turns (1.5 + 2.5) / 2; observations (0.2 * 30 / 0.5 + 0.3 * 40 / 1.5) / 2 = 10
    assert (t.turns, t.obs_tokens, t.env_s) == (2.0, 10, pytest.approx(0.2))
    cfg = _cfg(tmp_path, {"tools": ["m:f"], "max_turns": 3, "plan_env_s": 0.0,
                           "plan_turns": 3}, {"lengths_from": str(run)})
    t = turns_shape(cfg)
    assert (t.turns, t.obs_tokens, t.env_s) == (3.0, 10, 0.0)
