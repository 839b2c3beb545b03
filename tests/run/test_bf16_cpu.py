"""bf16 on CPU (``dtype: bf16``): the GPU path's precision, exercised where CI runs.
megatron's mixed-precision optimizers keep fp32 main weights; the tiny GRPO (with and
without the distributed optimizer) and PPO learn, a SIGKILL plus a resume gives the
uninterrupted run's weights bit for bit (the checkpoints hold the fp32 main weights),
and the final model says it holds bf16 tensors."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from realign.run.checkpoint import committed
from tests.run.conftest import experiment, kill_after
from tests.run.run_records import final_weights, metrics

pytestmark = [pytest.mark.cpu_dist, pytest.mark.slow]

REALIGN = [sys.executable, "-m", "realign.cli.main"]


def run(exp: Path, run_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*REALIGN, "run", str(exp), "--run-dir", str(run_dir)],
                          capture_output=True, text=True, timeout=400)


def resumed_after_kill(exp: Path, cut: Path, n_rows: int, checkpoint: str
                      ) -> dict[str, torch.Tensor]:
    """SIGKILL a run once ``n_rows`` steps are logged (past ``checkpoint``), run it again:
    it resumes from its newest checkpoint (``checkpoint`` or a later one: the kill lands
    a few steps after the row); its final actor weights."""
    kill_after(exp, cut, n_rows)
    found = committed(cut)
    assert found and found[-1][1].name >= checkpoint, found
    assert not (cut / "final").exists()          # cut before its end
    r = run(exp, cut)
    assert r.returncode == 0 and "resuming from" in r.stdout, r.stderr[-3000:]
    assert found[-1][1].name in r.stdout, r.stdout
    return final_weights(cut)


def mean(xs) -> float:
    return sum(xs) / len(xs)


@pytest.mark.parametrize("zero1", [False, True])
def test_bf16_grpo_learns_and_resumes_bit_identically(tiny_assets, tmp_path, zero1):
    exp = experiment(tiny_assets, "tiny-grpo-cpu", tmp_path, dtype="bf16", run__steps=14,
                     run__checkpoint_interval=5, train__distributed_optimizer=zero1)
    whole = tmp_path / "whole"
    r = run(exp, whole)
    assert r.returncode == 0, r.stderr[-3000:]
    rewards = [row["reward_mean"] for row in metrics(whole)]
    assert mean(rewards[-3:]) > mean(rewards[:3]) + 0.05, rewards
    weights = final_weights(whole)
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    config = json.loads((whole / "final" / "actor" / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16"
    cut = tmp_path / "cut"
    # past the step-5 checkpoint, 7 steps before the end
    again = resumed_after_kill(exp, cut, 7, "step_000005")
    assert again.keys() == weights.keys()
    assert all(torch.equal(again[k], weights[k]) for k in weights)
    assert [row["reward_mean"] for row in metrics(cut)] == rewards


@pytest.mark.parametrize("zero1", [False, True])
def test_bf16_ppo_learns(tiny_assets, tmp_path, zero1):
    exp = experiment(tiny_assets, "tiny-ppo-cpu", tmp_path, dtype="bf16",
                     train__distributed_optimizer=zero1)
    r = run(exp, tmp_path / "run")
    assert r.returncode == 0, r.stderr[-3000:]
    got = metrics(tmp_path / "run")
    for row in got:
        for key in ("critic.loss", "actor.loss", "actor.grad_norm", "reward_mean"):
            assert math.isfinite(row[key]), (key, row)
    critic = [row["critic.loss"] for row in got]
    assert mean(critic[-3:]) < mean(critic[:3]), critic
