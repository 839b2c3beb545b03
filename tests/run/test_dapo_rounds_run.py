"""DAPO sampling in rounds on the tiny task (no over-generation, so any constant group
sends the step back for another round): steps that needed a second round train a
full batch, later rounds are sized from the drop rate seen, and a SIGKILL plus a
resume repeats every round (its size and prompts) bit for bit. On the shipped setting
(experiments/tiny-dapo-rounds-cpu.yaml) every step of the run trains a full batch."""
from __future__ import annotations

import pytest
import torch

from realign.run.checkpoint import committed
from tests.run.conftest import experiment, kill_after
from tests.run.run_records import final_weights, metrics
from tests.run.test_run_controller import run

pytestmark = pytest.mark.cpu_dist

STEPS = 6


def dapo(assets, tmp_path, rounds: int):
    return experiment(assets, "tiny-dapo-cpu", tmp_path, algorithm__dropped_group_frac=None,
                      algorithm__params__max_sampling_rounds=rounds, run__steps=STEPS,
                      run__checkpoint_interval=2)


@pytest.mark.slow
def test_sampling_rounds_fill_the_batch_and_resume_bit_identically(tiny_assets, tmp_path):
    exp = dapo(tiny_assets, tmp_path / "r", 4)
    whole = tmp_path / "whole"
    r = run(exp, whole)
    assert r.returncode == 0, r.stderr[-3000:]
    got = metrics(whole)
    rounds = [row["actor.sampling_rounds"] for row in got]
    assert max(rounds) > 1, rounds
    for row in got:
        kept, dropped = row["actor.kept_groups"], row["actor.dropped_groups"]
        sizes = row["actor.round_prompts"]
        assert len(kept) == len(dropped) == len(sizes) == row["actor.sampling_rounds"]
        # the first round generated for 16 prompts, a later one for as many as the
        # missing groups need at the rate seen (at most 8 x 16); it ran only while short
        assert sizes[0] == 16 and all(1 <= n <= 128 for n in sizes)
        assert all(k + d <= n for k, d, n in zip(kept, dropped, sizes))
        assert all(sizes[i] >= 16 - sum(kept[:i]) for i in range(1, len(sizes)))
        assert all(sum(kept[:i]) < 16 for i in range(1, len(kept)))
        assert row["actor.batch_full"] == float(sum(kept) == 16)
        assert row["actor.shortfall_frac"] == (16 - sum(kept)) / 16
    assert any(row["actor.batch_full"] == 1.0 and row["actor.sampling_rounds"] > 1
               for row in got)
    # a second round is timed on its own
    assert any("time.actor.generate.round2" in row for row in got)
    # one round only: the same first round, short where constant groups were dropped
    once = tmp_path / "once"
    r = run(dapo(tiny_assets, tmp_path / "o", 1), once)
    assert r.returncode == 0, r.stderr[-3000:]
    first = metrics(once)[0]
    assert "actor.sampling_rounds" not in first
    assert first["actor.dropped_group_frac"] == got[0]["actor.dropped_groups"][0] / 16
    cut = tmp_path / "cut"
    kill_after(exp, cut, 3)
    assert committed(cut), "no committed checkpoint before the kill"
    r = run(exp, cut)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming from" in r.stdout
    again = metrics(cut)
    assert [row["step"] for row in again] == list(range(STEPS))
    a, b = final_weights(whole), final_weights(cut)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for key in ("actor.kept_groups", "actor.dropped_groups", "actor.round_prompts",
                "actor.dropped_frac_seen", "reward_mean", "loss"):
        assert [row[key] for row in again] == [row[key] for row in got], key


@pytest.mark.slow
def test_every_step_of_the_shipped_rounds_setting_trains_a_full_batch(tiny_assets, tmp_path):
    """experiments/tiny-dapo-rounds-cpu.yaml whole (30 steps): the share of constant
    groups climbs past what one round of 30 prompts can absorb, and every step still
    trains 16 informative groups within its 4 rounds."""
    exp = experiment(tiny_assets, "tiny-dapo-rounds-cpu", tmp_path)
    out = tmp_path / "run"
    r = run(exp, out, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    got = metrics(out)
    assert len(got) == 30
    assert all(row["actor.batch_full"] == 1.0 for row in got), [
        (row["step"], row["actor.kept_groups"]) for row in got if row["actor.batch_full"] < 1]
    # steps whose first round fell short (where over-generating once trains short)
    short = [row for row in got if row["actor.kept_groups"][0] < 16]
    assert len(short) >= 5, [row["actor.kept_groups"] for row in got]
    assert all(row["actor.sampling_rounds"] > 1 for row in short)
    assert max(row["actor.dropped_group_frac"] for row in got) > 0.6
    assert all(max(row["actor.round_prompts"]) <= 240 for row in got)
