"""ReMax streams (``rollout.mode: streaming``, 1x2 on CPU: GPU 0 streams the rollout,
GPU 1 trains): its baseline, a greedy response per prompt, is decoded in the stream as
one more sample of each group (the group's last slot, chosen greedily), with the same
weights' versions as the group and within the staleness bound, and streamed with the
group as ``greedy_seqs`` and its rule reward ``greedy_rewards``. The advantage is the
sampled reward less the greedy one; the same run twice gives the same metrics."""
from __future__ import annotations

import math

import pytest

from tests.run.conftest import experiment
from tests.run.run_records import metrics
from tests.run.test_run_controller import run
from tests.run.test_stream_run import STREAM_MANUAL, untimed

pytestmark = pytest.mark.cpu_dist

#: the greedy baseline decodes on the generator's GPU, in the same copy as the rollout
REMAX_MANUAL = {**STREAM_MANUAL, "actor.greedy_generate": STREAM_MANUAL["actor.generate"]}


def test_remax_streams_its_greedy_baseline_with_each_group_and_repeats(tiny_assets, tmp_path):
    exp = experiment(tiny_assets, "tiny-grpo-async-cpu", tmp_path, **{
        "plan__manual": REMAX_MANUAL, "rollout__mode": "streaming",
        "rollout__on_update": "continue", "algorithm__max_staleness": 1,
        "algorithm__gen_len": 8, "algorithm__name": "remax",
        "algorithm__params": {"kl_coef": 0.0, "clip_ratio": 0.2}, "run__steps": 3})
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
        assert 0 <= row["actor.staleness"] <= row["stream.staleness_max"]
        # the baseline's rule reward streamed beside the group's
        assert math.isfinite(row["greedy_reward_mean"]) and math.isfinite(row["reward_mean"])
    assert any(row["actor.staleness"] > 0 for row in got[1:])
    assert untimed(rows[0]) == untimed(rows[1])
