"""DAPO streams (``rollout.mode: streaming``, 1x2 on CPU: GPU 0 streams the rollout,
GPU 1 trains): its dynamic sampling happens at the rollout buffer. A finished group
whose rule rewards are all equal is dropped there and counted
(``stream.dropped_constant``), never trained; the generator keeps generating new
prompts until a batch of ``prompts_per_step`` informative groups is there, so every
trained group is informative (``actor.shortfall_frac`` 0: no constant group fills a
batch) and the train call trains the batch whole. Clip-higher and the token-level loss
are DAPO's own. The same run twice gives the same metrics row for row, and a run killed
and resumed ends with the same weights and metrics."""
from __future__ import annotations

import math

import pytest
import torch

from realign.run.checkpoint import committed
from tests.run.conftest import experiment, kill_after
from tests.run.run_records import final_weights, metrics
from tests.run.test_run_controller import run
from tests.run.test_stream_run import STREAM_MANUAL, untimed

pytestmark = pytest.mark.cpu_dist


def dapo_stream(assets, tmp, **changes):
    return experiment(assets, "tiny-dapo-cpu", tmp, **{
        "plan__manual": STREAM_MANUAL, "rollout__mode": "streaming",
        "rollout__on_update": "continue", "algorithm__max_staleness": 1,
        "algorithm__gen_len": 8, "run__steps": 3, **changes})


def test_dapo_streams_dropping_constant_groups_at_the_buffer_and_repeats(tiny_assets,
                                                                         tmp_path):
    exp = dapo_stream(tiny_assets, tmp_path)
    rows = []
    for name in ("a", "b"):
        r = run(exp, tmp_path / name, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        rows.append(metrics(tmp_path / name))
    got = rows[0]
    assert [row["step"] for row in got] == [0, 1, 2]
    for row in got:
        assert math.isfinite(row["loss"]) and math.isfinite(row["actor.grad_norm"])
        assert 0 <= row["stream.staleness_max"] <= 1
        # the batch is the informative groups the buffer kept, trained whole: none a
        # constant filler, and the sampling-round statistics of a step-by-step run absent
        assert row["actor.shortfall_frac"] == 0.0
        assert "actor.dropped_group_frac" not in row
        assert row["stream.dropped_constant"] >= 0
        assert "actor.clip_frac" in row                       # DAPO's clipped loss ran
    # the tiny task's shaped reward makes some groups constant: dropped and counted
    assert sum(row["stream.dropped_constant"] for row in got) > 0
    assert untimed(rows[0]) == untimed(rows[1])


def test_rewards_that_never_differ_stop_the_stream_naming_the_reward(tiny_assets, tmp_path):
    """Every group constant: the buffer never fills a batch; once 100 batches' worth
    of groups are dropped the run stops, naming reward.fn, instead of generating on."""
    (tiny_assets / "flat_reward.py").write_text(
        "def flat(prompt, response, answer):\n    return 0.5\n")
    exp = dapo_stream(tiny_assets, tmp_path, reward__fn="flat_reward.py:flat",
                      algorithm__prompts_per_step=2, algorithm__dropped_group_frac=None)
    r = run(exp, tmp_path / "run", timeout=600)
    assert r.returncode != 0
    assert "reward.fn" in r.stderr and "equal rewards" in r.stderr, r.stderr[-3000:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or \
        not (tmp_path / "run" / "metrics.jsonl").read_text().strip()


@pytest.mark.slow
def test_a_killed_dapo_stream_resumes_as_if_uninterrupted(tiny_assets, tmp_path):
    """kill -9 some steps in, resume from the newest checkpoint: the groups judged
    constant and dropped, the buffer and the sequences in flight come back, so the
    same groups are trained and the weights end bit for bit the same."""
    exp = dapo_stream(tiny_assets, tmp_path, run__steps=8, run__checkpoint_interval=2)
    whole = tmp_path / "whole"
    r = run(exp, whole, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    cut = tmp_path / "cut"
    kill_after(exp, cut, 3)
    found = committed(cut)
    assert found, "no committed checkpoint before the kill"
    assert 2 <= found[-1][0] < 8, found
    r = run(exp, cut, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming from" in r.stdout, r.stdout
    a, b = final_weights(whole), final_weights(cut)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert untimed(metrics(whole)) == untimed(metrics(cut))
    assert sum(row["stream.dropped_constant"] for row in metrics(whole)) > 0
