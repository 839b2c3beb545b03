"""``realign bench async``'s breakdown of the asynchronous step (pure)."""
from __future__ import annotations

import pytest

from realign.bench.async_gap import breakdown, call_times, lines, step_sides

pytestmark = pytest.mark.pure


def step(n: int, t0: float, gen: float, train: float) -> dict:
    """An asynchronous step on GPUs 0 (generation) and 1 (training): 1 s of weights and
    sends on both, then the generation beside the training."""
    return {"step": n, "events": [
        ["realloc actor -> actor.generate", "realloc", t0, t0 + 0.5, [0, 1]],
        ["send seqs", "send", t0 + 0.5, t0 + 1.0, [0, 1]],
        ["actor.generate (next step)", "generate", t0 + 1.0, t0 + 1.0 + gen, [0]],
        ["actor.train", "train", t0 + 1.0, t0 + 1.0 + train, [1]]]}


def test_a_step_splits_into_its_prefix_and_the_two_sides():
    s = step_sides(step(0, 10.0, 3.0, 5.0)["events"], {0})
    assert s == pytest.approx({"prefix_s": 1.0, "gen_s": 3.0, "train_s": 5.0, "span_s": 6.0})
    # a step with one side only (the first step generates its own rollout first)
    only = [e for e in step(0, 0.0, 3.0, 5.0)["events"] if e[4] != [1]]
    assert step_sides(only, {0}) is None


def test_alternating_sides_cost_more_than_the_slower_mean():
    # the generation is the slower side in one step, the training in the next: each
    # side averages 4 s, yet every step lasts 5 s
    timeline = [step(0, 0.0, 9.0, 9.0), step(1, 20.0, 5.0, 3.0), step(2, 40.0, 3.0, 5.0),
                step(3, 60.0, 9.0, 9.0)]
    rows = [{"step": i, "step_time_s": w, "time.actor.generate": g, "time.actor.train": t}
            for i, (w, g, t) in enumerate([(10.0, 9.0, 9.0), (6.5, 5.0, 3.0),
                                           (6.5, 3.0, 5.0), (10.0, 9.0, 9.0)])]
    alone = [[{"step": i, "step_time_s": 7.0, "time.actor.generate": 3.2,
               "time.actor.train": 4.0} for i in range(4)]]
    b = breakdown([timeline], [rows], {0}, alone, warmup=1)
    assert b["steps"] == 2                     # the warm-up step and the last left out
    assert b["prefix_s"] == pytest.approx(1.0)
    assert b["gen_s"] == pytest.approx(4.0) and b["train_s"] == pytest.approx(4.0)
    assert b["slower_side_s"] == pytest.approx(5.0)
    assert b["slower_side_excess_s"] == pytest.approx(1.0)
    assert b["between_steps_s"] == pytest.approx(0.5)
    assert b["step_s"] == pytest.approx(6.5)
    assert b["calls"]["actor.generate"]["slowdown"] == pytest.approx(4.0 / 3.2 - 1)
    assert b["calls"]["actor.train"]["slowdown"] == pytest.approx(0.0)
    text = "\n".join(lines(b))
    assert "exceeds the slower mean by 1000.0 ms" in text and "(+25 %)" in text
    assert breakdown([timeline], [rows], {0}, None, warmup=1).get("calls") is None
    assert lines(None) == []


def test_call_times_leave_out_reallocations():
    rows = [{"time.actor.train": 1.0, "time.realloc.actor.generate": 9.0},
            {"time.actor.train": 3.0}, {"time.actor.train": 2.0}]
    assert call_times(rows) == {"actor.train": 2.0}
