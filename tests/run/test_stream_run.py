"""Streaming runs end to end on CPU (``rollout.mode: streaming``, 1x2: GPU 0 streams the
rollout into the buffer while GPU 1 trains): GRPO trains on samples at most
``max_staleness`` versions old, with each token's policy version recorded, under both
update policies, PPO with a critic, RLOO, REINFORCE++, GSPO and Dr. GRPO; the same
run twice gives the same metrics row for row (the schedule counts decode iterations,
not seconds), a killed run resumes bit for bit, a dead side fails the run naming its
worker."""
from __future__ import annotations

import math

import pytest
import torch

from realign.run.checkpoint import committed
from tests.run.conftest import experiment, kill_after
from tests.run.run_records import final_weights, metrics
from tests.run.test_async_run import ASYNC_MANUAL
from tests.run.test_run_controller import run

pytestmark = pytest.mark.cpu_dist

#: metrics that depend on the wall clock (seconds), left out of the comparisons
TIMED = ("time", "stream.generator_wait_s", "stream.trainer_wait_s",
         "stream.generator_step_s", "step_time_s", "tokens_per_s")


#: the generator's slots a quarter of a step's samples (its call's 4 waves), so samples
#: begin while others decode and an update meets sequences in flight
STREAM_MANUAL = {**ASYNC_MANUAL,
                 "actor.generate": {**ASYNC_MANUAL["actor.generate"], "micro_batches": 4}}


def stream_experiment(assets, tmp, on_update, **changes):
    return experiment(assets, "tiny-grpo-async-cpu", tmp, plan__manual=STREAM_MANUAL,
                      rollout__mode="streaming", rollout__on_update=on_update,
                      algorithm__max_staleness=1, algorithm__gen_len=8,
                      sampling__temperature=1.0, **changes)


def untimed(rows):
    return [{k: v for k, v in row.items() if not k.startswith(TIMED)} for row in rows]


@pytest.mark.parametrize("on_update", ["finish", "continue"])
def test_a_streaming_run_trains_on_bounded_stale_samples_and_repeats(tiny_assets, tmp_path,
                                                                      on_update):
    exp = stream_experiment(tiny_assets, tmp_path, on_update, run__steps=5)
    rows = []
    for name in ("a", "b"):
        r = run(exp, tmp_path / name, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        rows.append(metrics(tmp_path / name))
    got = rows[0]
    assert [row["step"] for row in got] == list(range(5))
    for row in got:
        assert math.isfinite(row["loss"]) and math.isfinite(row["actor.grad_norm"])
        # every trained sample within the bound (the train call checks each row too)
        assert 0 <= row["stream.staleness_max"] <= 1
        assert 0 <= row["actor.staleness"] <= row["stream.staleness_max"]
        assert row["stream.buffer_depth"] >= 0 and row["stream.dropped_stale"] >= 0
        assert "stream.trainer_wait_s" in row and "stream.generator_wait_s" in row
    # the generator streamed ahead of the trainer: later steps train older samples
    assert got[0]["actor.staleness"] == 0.0
    assert any(row["actor.staleness"] > 0 for row in got[1:])
    if on_update == "continue":      # a sample's tokens made by two versions
        assert any(row["stream.token_version_span"] == 2.0 for row in got)
    else:                            # finish: one version per sample
        assert all(row["stream.token_version_span"] == 1.0 for row in got)
    assert untimed(rows[0]) == untimed(rows[1])


@pytest.mark.slow
def test_a_killed_streaming_run_resumes_as_if_uninterrupted(tiny_assets, tmp_path):
    """kill -9 some steps in, resume from the newest checkpoint: the buffer, the
    sequences in flight (their cache included) and the schedule come back, so the
    same samples are trained and the final weights are bit for bit the same."""
    exp = stream_experiment(tiny_assets, tmp_path, "continue", run__steps=10,
                            run__checkpoint_interval=2)
    whole = tmp_path / "whole"
    r = run(exp, whole, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    cut = tmp_path / "cut"
    kill_after(exp, cut, 3)
    found = committed(cut)
    assert found, "no committed checkpoint before the kill"
    done, newest = found[-1]
    assert 2 <= done < 10, found
    state = torch.load(newest / "rank0.pt", weights_only=False)
    assert state["stream"]["decoder"]["slots"], "the generator's state is saved"
    r = run(exp, cut, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming from" in r.stdout, r.stdout
    a, b = final_weights(whole), final_weights(cut)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert untimed(metrics(whole)) == untimed(metrics(cut))


def test_a_call_on_the_generators_gpu_is_refused_before_any_worker(tiny_assets, tmp_path):
    on_gpu0 = {"mesh": {"first_gpu": 0, "n_gpus": 1}, "layout": {"tp": 1, "pp": 1, "dp": 1}}
    exp = experiment(tiny_assets, "tiny-grpo-async-cpu", tmp_path, rollout__mode="streaming",
                     plan__manual={**ASYNC_MANUAL, "actor.prox_inference": on_gpu0})
    r = run(exp, tmp_path / "run")
    assert r.returncode == 2, r.stderr[-3000:]
    assert "plan.manual.actor.prox_inference.mesh" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("victim", [0, 1], ids=["generator", "trainer"])
def test_a_dead_side_fails_the_run_within_seconds_naming_it(tiny_assets, tmp_path, victim):
    from tests.run.test_run_controller import kill_a_worker

    exp = stream_experiment(tiny_assets, tmp_path, "continue", run__steps=400)
    code, err, seconds = kill_a_worker(exp, tmp_path / "run", victim)
    assert seconds < 30
    assert code == 1
    assert "failed" in err and f"worker {victim}" in err, err[-2000:]


#: PPO's calls other than the rollout on GPU 1
PPO_MANUAL = {name: ASYNC_MANUAL["actor.train"] for name in (
    "ref.inference", "reward.inference", "critic.inference", "actor.prox_inference",
    "actor.train", "critic.train")} | {"actor.generate": STREAM_MANUAL["actor.generate"]}


def test_ppo_with_a_critic_streams(tiny_assets, tmp_path):
    """The training side runs whatever the step's other calls are: the reference, the
    reward model and the critic score each streamed batch, actor and critic train."""
    exp = experiment(tiny_assets, "tiny-ppo-cpu", tmp_path, plan__manual=PPO_MANUAL,
                     rollout__mode="streaming", algorithm__max_staleness=1, run__steps=4)
    r = run(exp, tmp_path / "run", timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = metrics(tmp_path / "run")
    assert [row["step"] for row in got] == list(range(4))
    for row in got:
        assert math.isfinite(row["actor.loss"]) and math.isfinite(row["critic.loss"])
        assert row["stream.staleness_max"] <= 1
    assert any(row["actor.staleness"] > 0 for row in got[1:])


#: each critic-free algorithm's own parameters (no reference model: no KL term)
STREAM_ALGORITHMS = {
    "rloo": {"kl_coef": 0.0, "clip_ratio": 0.2},
    "reinforce_pp": {"kl_coef": 0.0, "clip_ratio": 0.2},
    "gspo": {"kl_coef": 0.0, "clip_ratio": 3.0e-4, "clip_ratio_high": 4.0e-4},
    "dr_grpo": {"kl_coef": 0.0, "clip_ratio": 0.2},
}


@pytest.mark.parametrize("name", sorted(STREAM_ALGORITHMS))
def test_every_critic_free_algorithm_streams(tiny_assets, tmp_path, name):
    """RLOO, REINFORCE++, GSPO and Dr. GRPO stream like GRPO: their advantages are
    computed on the training side from each streamed batch, every trained sample is
    within the staleness bound; GSPO's loss is its own (a sequence ratio clipped on
    each side: clip_frac_low and clip_frac_high), the others' the token-level clip."""
    exp = stream_experiment(tiny_assets, tmp_path, "finish", run__steps=2,
                            algorithm__name=name, algorithm__params=STREAM_ALGORITHMS[name])
    r = run(exp, tmp_path / "run", timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = metrics(tmp_path / "run")
    assert [row["step"] for row in got] == [0, 1]
    for row in got:
        assert math.isfinite(row["loss"]) and math.isfinite(row["actor.grad_norm"])
        assert 0 <= row["stream.staleness_max"] <= 1
        assert 0 <= row["actor.staleness"] <= row["stream.staleness_max"]
        assert ("actor.clip_frac_high" in row) == (name == "gspo")
        assert ("actor.clip_frac_low" in row) == (name == "gspo")
