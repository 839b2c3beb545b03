"""Asynchronous runs end to end on CPU (1x2: the actor generates the next step's
rollout on GPU 0 while GPU 1 trains on this one): one-step-stale samples with their
policy versions and the decoupled loss, exact resume with the samples in flight, and
a dead worker on either side failing fast."""
from __future__ import annotations

import json

import pytest
import torch

from realign.run.checkpoint import committed
from tests.run.conftest import experiment, kill_after
from tests.run.run_records import final_weights, metrics
from tests.run.test_run_controller import kill_a_worker, run

pytestmark = pytest.mark.cpu_dist

#: the asynchronous plan of tiny-grpo-async-cpu, placed by hand (the search may prefer
#: the synchronous plan on a CPU)
ASYNC_MANUAL = {
    "actor.generate": {"mesh": {"first_gpu": 0, "n_gpus": 1}, "layout": {"tp": 1, "pp": 1, "dp": 1}},
    "actor.prox_inference": {"mesh": {"first_gpu": 1, "n_gpus": 1},
                             "layout": {"tp": 1, "pp": 1, "dp": 1}},
    "actor.train": {"mesh": {"first_gpu": 1, "n_gpus": 1}, "layout": {"tp": 1, "pp": 1, "dp": 1}},
}


def async_experiment(assets, tmp, **changes):
    return experiment(assets, "tiny-grpo-async-cpu", tmp, plan__manual=ASYNC_MANUAL, **changes)


@pytest.mark.slow
def test_async_run_trains_on_stale_samples_and_resumes_bit_identically(tiny_assets, tmp_path):
    exp = async_experiment(tiny_assets, tmp_path, run__steps=12, run__checkpoint_interval=2)
    whole = tmp_path / "whole"
    r = run(exp, whole)
    assert r.returncode == 0, r.stderr[-3000:]
    plan = json.loads((whole / "plan.json").read_text())
    assert plan["graph"]["ahead_steps"] == 1
    rows = metrics(whole)
    assert [row["step"] for row in rows] == list(range(12))
    # step 0 trains on its own rollout (made first), every later step on the one the
    # previous step generated while it trained: one version stale, never more
    assert rows[0]["actor.staleness"] == 0.0
    assert all(row["actor.staleness"] == 1.0 for row in rows[1:])
    assert all("actor.behave_weight" in row and "time.actor.prox_inference" in row
               for row in rows)
    assert any(row["actor.behave_weight"] != 1.0 for row in rows[1:])
    # the last step generates nothing ahead
    assert "time.actor.generate" in rows[-2] and "time.actor.generate" not in rows[-1]
    cut = tmp_path / "cut"
    kill_after(exp, cut, 3)
    # the newest checkpoint before the kill (a few steps after the third row)
    found = committed(cut)
    assert found, "no committed checkpoint before the kill"
    done, newest = found[-1]
    assert 2 <= done < 12, found                        # the run was cut before its end
    manifest = json.loads((newest / "manifest.json").read_text())
    assert manifest["in_flight_ranks"] == [0]          # GPU 0 holds the next step's rollout
    state = torch.load(newest / "rank0.pt", weights_only=False)
    # generated ahead during step done - 1, by the policy that step's weights were
    assert int(state["in_flight"]["records"]["seqs"]["policy_version"][0]) == done - 1
    r = run(exp, cut)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming from" in r.stdout and newest.name in r.stdout, r.stdout
    a, b = final_weights(whole), final_weights(cut)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for key in ("reward_mean", "actor.staleness", "actor.behave_weight", "response_len"):
        assert [row[key] for row in metrics(whole)] == [row[key] for row in metrics(cut)], key


def test_an_async_run_evaluates_at_interval_one(tiny_assets, tmp_path):
    """eval.interval 1: the held-out generations run every step, on the training side,
    and are not taken for the rollout generated ahead."""
    from tests.run.test_eval_and_demo import EVAL, eval_rows_are_prefixed

    on_gpu1 = {"mesh": {"first_gpu": 1, "n_gpus": 1}, "layout": {"tp": 1, "pp": 1, "dp": 1}}
    exp = experiment(tiny_assets, "tiny-grpo-async-cpu", tmp_path, run__steps=3,
                     eval={**EVAL, "interval": 1},
                     plan__manual={**ASYNC_MANUAL, "actor.eval_greedy": on_gpu1,
                                   "actor.eval_sample": on_gpu1})
    r = run(exp, tmp_path / "run")
    assert r.returncode == 0, r.stderr[-3000:]
    got = metrics(tmp_path / "run")
    assert [row["step"] for row in got] == [0, 1, 2]
    assert [row["actor.staleness"] for row in got] == [0.0, 1.0, 1.0]
    eval_rows_are_prefixed(got, 64)


@pytest.mark.parametrize("victim", [0, 1], ids=["generating-worker", "training-worker"])
def test_a_dead_worker_on_either_side_fails_fast(tiny_assets, tmp_path, victim):
    exp = async_experiment(tiny_assets, tmp_path, run__steps=400)
    code, err, seconds = kill_a_worker(exp, tmp_path / "run", victim)
    assert seconds < 30
    assert code == 1
    assert "failed" in err and "worker" in err


def test_a_sample_beyond_the_staleness_bound_stops_the_run():
    from realign.errors import UserError
    from realign.worker.calls import check_staleness
    batch = {"policy_version": torch.tensor([3, 3, 2])}
    assert check_staleness(batch, 3, 1, "actor.train") == pytest.approx(1 / 3)
    with pytest.raises(UserError, match="2 versions stale") as e:
        check_staleness(batch, 4, 1, "actor.train")
    assert e.value.field == "algorithm.max_staleness"
    with pytest.raises(UserError, match="stale"):          # a version from the future
        check_staleness({"policy_version": torch.tensor([5])}, 4, 1, "actor.train")
    assert check_staleness({"tokens": torch.zeros(2, 3)}, 4, 1, "actor.train") is None


@pytest.mark.parametrize("name", ["tiny-dapo-cpu", "tiny-gspo-cpu", "tiny-dr-grpo-cpu"])
def test_the_new_policy_gradients_run_asynchronously(tiny_assets, tmp_path, name):
    """DAPO, GSPO and Dr. GRPO on the asynchronous plan: their losses take the proximal
    policy's log-probs (GSPO per sequence), and DAPO's proximal pass scores every
    generated sequence before dynamic sampling chooses the rows to train."""
    exp = experiment(tiny_assets, name, tmp_path, plan__manual=ASYNC_MANUAL,
                     algorithm__max_staleness=1, run__steps=4)
    r = run(exp, tmp_path / "run")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = metrics(tmp_path / "run")
    assert [row["actor.staleness"] for row in rows] == [0, 1, 1, 1]
    assert all("actor.behave_weight" in row for row in rows)
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    n = {m["name"]: m["n_seqs"] for m in plan["graph"]["mfcs"]}
    assert n["actor.prox_inference"] == n["actor.generate"]
