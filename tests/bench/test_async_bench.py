"""``realign bench async``'s statistics and picture (pure), and the staleness setting."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from realign.bench.async_bench import (
    _bounds,
    compare,
    final_reward,
    kept_times,
    stream_stats,
    summarize_mode,
    table,
)
from realign.bench.async_svg import render
from realign.errors import UserError

pytestmark = pytest.mark.pure


def rows(times, rewards):
    return [{"step": i, "step_time_s": t, "reward_mean": r, "actor.staleness": float(i > 0)}
            for i, (t, r) in enumerate(zip(times, rewards))]


def test_steady_state_times_leave_out_warmup_and_the_last_step():
    r = rows([9, 1, 2, 3, 0.1], [0, 0, 0, 0, 0])
    assert kept_times(r, 1) == [1, 2, 3]
    assert final_reward(rows([1] * 4, [0.0, 0.2, 0.4, 0.6]), 2) == pytest.approx(0.5)


def test_speedups_and_final_rewards():
    sync_runs = [{"rows": rows([5, 2.0, 2.2, 2.4, 1], [0, .1, .2, .3, .4])},
                 {"rows": rows([5, 2.0, 2.0, 2.0, 1], [0, .1, .2, .3, .6])}]
    async_runs = [{"rows": rows([5, 1.0, 1.1, 1.2, 1], [0, .1, .2, .3, .5])},
                  {"error": "exit 1"}]
    s = summarize_mode(2.0, sync_runs, 1, 2)
    a = summarize_mode(1.25, async_runs, 1, 2)
    one = summarize_mode(3.0, [{"rows": rows([5, 3.0, 3.0, 3.0, 1], [0] * 5)}], 1, 2)
    assert s["measured_s"] == pytest.approx(2.0) and a["measured_s"] == pytest.approx(1.1)
    assert s["spread_s"]["min"] == 2.0 and s["spread_s"]["max"] == 2.2
    assert a["rounds_failed"] == 1
    assert s["final_reward"]["mean"] == pytest.approx(0.4)
    c = compare(s, a, one)
    assert c["predicted_speedup"] == pytest.approx(1.6)
    assert c["measured_speedup"] == pytest.approx(2.0 / 1.1)
    assert c["speedup_error"] == pytest.approx((2.0 / 1.1) / 1.6 - 1)
    assert c["sync_dp_scaling"] == pytest.approx(1.5)
    assert c["final_reward_gap"] == pytest.approx(0.4 - 0.4)
    rec = {"experiment": "x.yaml", "config": {"seeds": 2, "steps": 5, "warmup": 1,
                                              "final_window": 2, "experiment": {}},
           "modes": {"synchronous": s, "asynchronous": a}, "summary": c,
           "errors": {"asynchronous": ["exit 1"]},
           "curves": {"synchronous": [[r["reward_mean"] for r in run["rows"]] for run in sync_runs],
                      "asynchronous": [[0, .1, .2, .3, .5], None]}}
    text = table(rec)
    assert "predicted 1.60x" in text and "a round failed" in text
    assert "response lengths" not in text
    rec["lengths"] = {"cap": 8, "planned": {"cap": 8, "mean": 4.0, "at_cap": 0.01},
                      "measured": {"responses": 16, "mean": 5.0, "at_cap": 0.25}}
    assert "measured mean 5.0, 25.0 % at the cap (16 responses" in table(rec)
    svg = render(rec)
    assert svg.startswith("<svg") and svg.count("<path") == 3 + 2   # 3 seeds + 2 means
    assert "predicted 1.60x" in svg


def test_streaming_bounds_stats_and_speedups():
    assert _bounds("1,2,4") == (1, 2, 4)
    for bad in ("0", "1,x", "2,2", ""):
        with pytest.raises(UserError, match="--streaming|staleness"):
            _bounds(bad)

    def streamed(times, hist, dropped):
        # per step: groups trained at each staleness, groups dropped as too stale
        return [{**r, **{f"stream.staleness_hist.{k}": v for k, v in h.items()},
                 "stream.dropped_stale": d}
                for r, h, d in zip(rows(times, [0, .1, .2, .3, .6]), hist, dropped)]
    hist = [{0: 2}, {0: 1, 1: 1}, {1: 2}, {1: 1, 2: 1}, {2: 2}]
    runs = [{"rows": streamed([5, 1.0, 1.0, 1.0, 1], hist, [0, 0, 1, 0, 2])},
            {"error": "exit 1"}]
    st = stream_stats(runs)
    assert st["groups_trained"] == [10.0]
    assert st["staleness_mean"] == [pytest.approx((0 * 3 + 1 * 4 + 2 * 3) / 10)]
    assert st["dropped_stale"] == [3.0]
    sync = summarize_mode(2.0, [{"rows": rows([5, 2.0, 2.0, 2.0, 1], [0, .1, .2, .3, .4])}], 1, 2)
    stream = summarize_mode(0.8, runs, 1, 2)
    stream["stream"] = st
    c = compare(sync, stream, None)
    assert c["predicted_speedup"] == pytest.approx(2.5)
    assert c["measured_speedup"] == pytest.approx(2.0)
    assert c["speedup_error"] == pytest.approx(2.0 / 2.5 - 1)
    assert c["final_reward_gap"] == pytest.approx(0.45 - 0.35)
    rec = {"experiment": "x.yaml", "config": {"seeds": 1, "steps": 5, "warmup": 1},
           "modes": {"synchronous": sync, "streaming k=2": stream},
           "summary": {"predicted_speedup": 1.0, "measured_speedup": None,
                       "speedup_error": None, "streaming": {"streaming k=2": c}},
           "errors": {}}
    text = table(rec)
    assert ("streaming k=2 speed-up: predicted 2.50x, measured 2.00x (error -20.0 %); "
            "staleness mean 1.00, dropped 3; final reward - synchronous +0.100") in text


def test_max_staleness_is_checked():
    from realign.config.experiment import AlgorithmSection
    grpo = {"name": "grpo", "samples_per_prompt": 4}       # GRPO's groups: 2 or more
    with pytest.raises(ValidationError, match="max_staleness"):
        AlgorithmSection(**grpo, max_staleness=-1)
    assert AlgorithmSection(**grpo).max_staleness == 0
    # the bound is no part of the batch shape (the planner's graph takes it apart)
    assert AlgorithmSection(**grpo, max_staleness=2).shape() == \
        AlgorithmSection(**grpo).shape()
