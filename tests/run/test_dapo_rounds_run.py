"""DAPO sampling in rounds on the tiny task (no over-generation, so any constant group
sends the step back for another round): steps that needed a second round train a
full batch, and a SIGKILL plus a resume repeats every round bit for bit."""
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
        assert len(kept) == len(dropped) == row["actor.sampling_rounds"]
        # each round generated for 16 prompts; a later round ran only while short
        assert all(k + d <= 16 for k, d in zip(kept, dropped))
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
    for key in ("actor.kept_groups", "actor.dropped_groups", "reward_mean", "loss"):
        assert [row[key] for row in again] == [row[key] for row in got], key
