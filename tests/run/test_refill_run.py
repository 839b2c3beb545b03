"""A run whose generation refills its slots (packed scoring and training on, as by
default) on tiny-reason's long-tailed responses, with a plan of several waves per rank
so slots do refill: its rollouts are those of static waves, in fewer decode steps, and
a SIGKILL plus a resume is bit identical."""
from __future__ import annotations

import pytest
import torch

from realign.run.checkpoint import committed
from tests.run.conftest import experiment, kill_after
from tests.run.run_records import final_weights, metrics
from tests.run.test_run_controller import run

pytestmark = pytest.mark.cpu_dist

MESH = {"first_gpu": 0, "n_gpus": 2}
DP2 = {"tp": 1, "pp": 1, "dp": 2}


def reason(assets, tmp_path, refill: bool, steps: int):
    return experiment(
        assets, "tiny-reason-async-cpu", tmp_path, algorithm__max_staleness=0,
        algorithm__prompts_per_step=4, rollout__refill=refill, run__steps=steps,
        run__checkpoint_interval=2, plan__manual={
            "actor.generate": {"mesh": MESH, "layout": DP2, "micro_batches": 4},
            "actor.train": {"mesh": MESH, "layout": DP2, "micro_batches": 1}})


@pytest.mark.slow
def test_a_refilling_run_samples_what_waves_sample_and_resumes_bit_identically(
        tiny_assets, tmp_path):
    steps = 6
    exp = reason(tiny_assets, tmp_path / "r", True, steps)
    whole = tmp_path / "whole"
    r = run(exp, whole)
    assert r.returncode == 0, r.stderr[-3000:]
    waves = tmp_path / "waves"
    r = run(reason(tiny_assets, tmp_path / "w", False, steps), waves)
    assert r.returncode == 0, r.stderr[-3000:]
    got, want = metrics(whole), metrics(waves)
    assert [row["reward_mean"] for row in got] == [row["reward_mean"] for row in want]
    assert [row["response_len"] for row in got] == [row["response_len"] for row in want]
    assert sum(row["decode_steps.actor.generate"] for row in got) < \
        sum(row["decode_steps.actor.generate"] for row in want)
    cut = tmp_path / "cut"
    kill_after(exp, cut, 3)
    assert committed(cut), "no committed checkpoint before the kill"
    r = run(exp, cut)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming from" in r.stdout
    assert [row["step"] for row in metrics(cut)] == list(range(steps))
    a, b = final_weights(whole), final_weights(cut)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [row["reward_mean"] for row in metrics(cut)] == [row["reward_mean"] for row in got]
