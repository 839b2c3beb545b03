"""The tiny CPU experiments learn: ``realign run experiments/tiny-{dpo,sft,ppo,rm}-cpu.yaml``
as a subprocess (2 gloo workers) on the tiny assets, then the first and last steps of
metrics.jsonl are compared. Seeds are fixed, so the numbers are those of the YAMLs'
comments; the margins leave room for a different torch build.

Measured (mean of the first k steps -> last k):
DPO (k=5 of 40) implicit-reward accuracy 0.40 -> 0.78, loss 0.695 -> 0.56;
SFT (k=5 of 20) loss 3.5 -> 1.5; RM (k=10 of 100) accuracy 0.48 -> 0.87, loss 0.70 -> 0.32;
PPO (10 steps) critic loss 0.08 -> 0.013.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.run.conftest import experiment
from tests.run.run_records import metrics

pytestmark = [pytest.mark.cpu_dist, pytest.mark.slow]

RUN_TIMEOUT_S = 180


def realign_run(assets: Path, name: str, tmp_path: Path, **changes) -> list[dict]:
    """Run the experiment to completion; its metrics.jsonl rows, one per step."""
    exp = experiment(assets, name, tmp_path, **changes)
    run_dir = tmp_path / "run"
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    r = subprocess.run([sys.executable, "-m", "realign.cli.main", "run", str(exp),
                        "--run-dir", str(run_dir)], capture_output=True, text=True,
                       timeout=RUN_TIMEOUT_S, env=env)
    assert r.returncode == 0, f"realign run {name} failed:\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    rows = metrics(run_dir)
    steps = experiment_steps(exp)
    assert [row["step"] for row in rows] == list(range(steps))
    return rows


def experiment_steps(path: Path) -> int:
    return yaml.safe_load(path.read_text())["run"]["steps"]


def first_last(rows: list[dict], key: str, k: int) -> tuple[float, float]:
    vals = [row[key] for row in rows]
    assert all(math.isfinite(v) for v in vals), (key, vals)
    return sum(vals[:k]) / k, sum(vals[-k:]) / k


def test_dpo_accuracy_rises_and_loss_falls(tiny_assets, tmp_path):
    rows = realign_run(tiny_assets, "tiny-dpo-cpu", tmp_path)
    acc0, acc1 = first_last(rows, "actor.reward_accuracy", 5)
    loss0, loss1 = first_last(rows, "actor.loss", 5)
    assert acc1 >= acc0 + 0.2, (acc0, acc1)
    assert loss1 <= loss0 - 0.07, (loss0, loss1)
    # the implicit rewards separate: chosen above rejected at the end
    m0, m1 = first_last(rows, "actor.reward_margin", 5)
    assert m1 > m0 and m1 > 0, (m0, m1)


def test_sft_loss_falls(tiny_assets, tmp_path):
    rows = realign_run(tiny_assets, "tiny-sft-cpu", tmp_path)
    loss0, loss1 = first_last(rows, "actor.loss", 5)
    assert loss1 <= 0.7 * loss0, (loss0, loss1)
    assert (tmp_path / "run" / "final" / "actor" / "config.json").is_file()


def test_ppo_runs_with_reward_model_and_trains_critic(tiny_assets, tmp_path):
    rows = realign_run(tiny_assets, "tiny-ppo-cpu", tmp_path)
    for row in rows:
        # the reward model scored the rollout (no rule reward runs under PPO with one)
        assert "time.reward.inference" in row and math.isfinite(row["reward_mean"])
        for key in ("critic.loss", "critic.value", "critic.grad_norm", "actor.loss",
                    "actor.kl", "time.critic.inference", "time.critic.train"):
            assert key in row and math.isfinite(row[key]), (key, row)
    # scores of a random value-head model on different samples: not all the same
    assert len({round(r["reward_mean"], 6) for r in rows}) > 1
    c0, c1 = first_last(rows, "critic.loss", 3)
    assert c1 < c0, (c0, c1)
    assert (tmp_path / "run" / "final" / "actor" / "config.json").is_file()


def test_rm_accuracy_rises_and_loss_falls(tiny_assets, tmp_path):
    rows = realign_run(tiny_assets, "tiny-rm-cpu", tmp_path)
    acc0, acc1 = first_last(rows, "reward.accuracy", 10)
    loss0, loss1 = first_last(rows, "reward.loss", 10)
    assert acc1 >= acc0 + 0.2 or loss1 <= loss0 - 0.2, (acc0, acc1, loss0, loss1)
    assert loss1 < loss0, (loss0, loss1)
    assert (tmp_path / "run" / "final" / "reward" / "config.json").is_file()


@pytest.mark.parametrize("actor", ["llama31_actor", "qwen3_actor"])
def test_grpo_learns_with_each_family(tiny_assets, tmp_path, actor):
    """The tiny GRPO with a LLaMA 3.1-shaped actor (rope scaling, the task's 12 tokens past
    its window of 8) and a Qwen3-shaped one (q/k norms, head_dim 2x hidden / heads, tied
    embeddings): the reward rises as with the LLaMA actor."""
    rows = realign_run(tiny_assets, "tiny-grpo-cpu", tmp_path, run__steps=24,
                       models__actor=f"tiny/{actor}")
    first, last = first_last(rows, "reward_mean", 5)
    assert last > first + 0.08, (actor, first, last)
