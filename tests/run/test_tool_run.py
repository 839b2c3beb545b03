"""`realign run` with an environment, end to end on CPU (2 gloo workers): every episode
is multi-turn, the observations are in the records and out of the loss, the rollout's
metrics reach metrics.jsonl and the progress line, and a SIGKILL plus a resume is bit
identical with a deterministic environment."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from realign.run.checkpoint import committed
from tests.run.conftest import experiment, kill_after
from tests.run.run_records import final_weights, metrics

pytestmark = pytest.mark.cpu_dist

ENV = '''
class Count:
    """Answers each turn with its length; rewards turns of even length; ends after two."""

    def reset(self, episode):
        self.turns = 0
        return ""

    def step(self, turn):
        self.turns += 1
        return (f"<tool_response>{len(turn)}</tool_response>", float(len(turn) % 2 == 0),
                self.turns >= 2)
'''


def run(exp: Path, run_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "realign.cli.main", "run", str(exp),
                           "--run-dir", str(run_dir)], capture_output=True, text=True,
                          timeout=600)


def test_an_environment_run_resumes_bit_identically(tiny_assets, tmp_path):
    (tiny_assets / "count_env.py").write_text(ENV)
    exp = experiment(tiny_assets, "tiny-tool-cpu", tmp_path, models__actor="tiny/tool_actor",
                     rollout__tools=None, rollout__env="count_env.py:Count",
                     rollout__max_turns=3, rollout__turn_tokens=8, algorithm__gen_len=40,
                     data__train__max_response_len=40, eval__interval=4, run__steps=8,
                     run__checkpoint_interval=2)
    whole = tmp_path / "whole"
    r = run(exp, whole)
    assert r.returncode == 0, r.stderr[-3000:]
    got = metrics(whole)
    assert [row["step"] for row in got] == list(range(8))
    for row in got:
        assert row["rollout.turns"] == 2.0           # the environment ends every episode
        assert row["rollout.env_errors"] == 0.0 and row["rollout.env_s"] >= 0.0
        assert 0.0 < row["rollout.masked_share"] < 1.0
        assert "rollout.turn1_reward" in row and "rollout.turn2_reward" in row
        # the rule reward (math_verify) plus the environment's two per-turn rewards
        assert row["reward_mean"] >= row["rollout.env_reward"] >= 0.0
    assert "eval.greedy_rollout.turns" in got[3]
    assert " turns 2 " in r.stdout and " masked " in r.stdout
    cut = tmp_path / "cut"
    kill_after(exp, cut, 3)
    assert committed(cut), "no committed checkpoint before the kill"
    assert not (cut / "final").exists()
    r = run(exp, cut)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming from" in r.stdout
    again = metrics(cut)
    assert [row["step"] for row in again] == list(range(8))
    keys = ("reward_mean", "rollout.masked_share", "rollout.env_reward", "rollout.turn2_reward")
    assert [[row[k] for k in keys] for row in got] == [[row[k] for k in keys] for row in again]
    a, b = final_weights(whole), final_weights(cut)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
