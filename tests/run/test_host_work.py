"""Host work priced from measurements: the experiment's batch and reward function
timed while planning with a profile (the workers' own code), kept when plan.cost sets
them, unpriced without a profile; realign's own step cost fitted from runs."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from realign.errors import UserError
from realign.profile.step_overhead import fit_step_costs, outside_ops_s
from realign.run.loading import load_experiment
from realign.run.planning import cost_config, with_profile
from tests.run.conftest import experiment

REPO = Path(__file__).resolve().parents[2]
PROFILE = REPO / "benchmarks" / "profile" / "cpu_2026-11-25_one-pass.json"


@pytest.mark.pure
def test_step_costs_fit_a_line_through_the_fewest_and_most_workers():
    s = fit_step_costs([(2, 9e-4), (1, 5e-4)])
    assert s.per_worker_s == pytest.approx(4e-4) and s.fixed_s == pytest.approx(1e-4)
    assert s.points == ((1.0, 5e-4), (2.0, 9e-4))
    # fewer workers costing more (noise) is no negative slope; one point is all fixed
    flat = fit_step_costs([(1, 6e-4), (2, 5e-4)])
    assert flat.per_worker_s == 0.0 and flat.fixed_s == pytest.approx(6e-4)
    assert fit_step_costs([(4, 3e-4)]).fixed_s == pytest.approx(3e-4)


@pytest.mark.pure
def test_the_time_outside_the_ops_is_the_step_minus_their_span(tmp_path):
    """Steps 0..3: warm-up 1 and the last left out; step 1 took 10 ms with ops from
    t=100.000 to 100.008 (2 ms outside), step 2 12 ms with ops spanning 9 ms (3 ms)."""
    rows = [{"step": k, "step_time_s": t} for k, t in enumerate((0.5, 0.010, 0.012, 0.4))]
    spans = {0: (0.0, 0.1), 1: (100.0, 100.008), 2: (200.0, 200.009), 3: (300.0, 300.1)}
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "timeline.jsonl").write_text("".join(
        json.dumps({"step": k, "events": [["a", "train", t0, t0 + 0.001, [0]],
                                          ["b", "train", t1 - 0.005, t1, [1]]]}) + "\n"
        for k, (t0, t1) in spans.items()))
    out = outside_ops_s(tmp_path, warmup=1)
    assert out == pytest.approx([0.002, 0.003])


@pytest.mark.cpu_dist
def test_with_a_profile_the_batch_and_the_reward_are_timed_here(tiny_assets, tmp_path):
    exp = experiment(tiny_assets, "tiny-grpo-cpu", tmp_path)
    cfg = load_experiment(exp)
    unpriced = cost_config(cfg, host_work=True)
    assert unpriced.batch_s == 0.0 and unpriced.reward_s_per_seq == 0.0
    timed = cost_config(with_profile(cfg, PROFILE), host_work=True)
    # a batch of 16 prompts, a digit-matching reward: microseconds to milliseconds
    assert 1e-6 < timed.batch_s < 0.05 and 1e-8 < timed.reward_s_per_seq < 0.01
    fixed = experiment(tiny_assets, "tiny-grpo-cpu", tmp_path, plan__cost={
        "batch_s": 0.002, "reward_s_per_seq": 0.0})
    cfg2 = load_experiment(fixed)
    kept = cost_config(with_profile(cfg2, PROFILE), host_work=True)
    assert kept.batch_s == 0.002 and kept.reward_s_per_seq == 0.0


@pytest.mark.cpu_dist
def test_a_reward_function_that_returns_no_number_fails_while_planning(tiny_assets, tmp_path):
    (tiny_assets / "bad_reward.py").write_text(
        "def text(prompt, response, answer):\n    return 'good'\n")
    exp = experiment(tiny_assets, "tiny-grpo-cpu", tmp_path, reward__fn="bad_reward.py:text")
    cfg = load_experiment(exp)
    with pytest.raises(UserError) as e:
        cost_config(with_profile(cfg, PROFILE), host_work=True)
    assert e.value.field == "reward.fn" and "'good'" in str(e.value)
