"""The plan's training-state offload run end to end on CPU (plan.cost.train_state_offload:
always): the tiny PPO's actor and critic park their gradients and optimizer state
between train calls, the plan and the run's program say so, training is bit-identical
to the same plan without it, and a SIGKILL plus a resume (the checkpoint reads the
parked state back) gives the uninterrupted run's weights bit for bit."""
from __future__ import annotations

import json

import pytest
import torch

from tests.run.conftest import experiment
from tests.run.run_records import final_weights, metrics
from tests.run.test_bf16_cpu import resumed_after_kill, run

pytestmark = [pytest.mark.cpu_dist, pytest.mark.slow]


def test_training_state_offload_runs_resumes_and_changes_nothing(tiny_assets, tmp_path):
    plans = {}
    weights = {}
    for mode in ("never", "always"):
        exp = experiment(tiny_assets, "tiny-ppo-cpu", tmp_path, run__steps=12,
                         run__checkpoint_interval=3, plan__cost__train_state_offload=mode)
        r = run(exp, tmp_path / mode)
        assert r.returncode == 0, r.stderr[-3000:]
        plan = json.loads((tmp_path / mode / "plan.json").read_text())
        plans[mode] = {a["mfc"]: a for a in plan["allocations"]}
        weights[mode] = final_weights(tmp_path / mode)
    for name, a in plans["always"].items():
        assert a["train_state_offload"] == (a["kind"] == "train"), name
        b = plans["never"][name]
        assert (a["mesh"]["n_gpus"], a["layout"], a["micro_batches"]) == (
            b["mesh"]["n_gpus"], b["layout"], b["micro_batches"]), name
        assert not b["train_state_offload"]
    # the same calls share a mesh (the search may pick the mirror image of a plan: the
    # two GPUs of the tiny cluster are alike)
    assert sharing(plans["always"]) == sharing(plans["never"])
    assert plans["always"]["actor.train"]["host_bytes"] > 0
    whole, off = weights["never"], weights["always"]
    assert whole.keys() == off.keys() and all(torch.equal(whole[k], off[k]) for k in whole)
    cut = tmp_path / "cut"          # exp: the "always" copy, experiment() wrote it last
    # past the step-3 checkpoint, 7 steps before the end (a kill after the last step
    # would find a finished run, nothing to resume)
    again = resumed_after_kill(exp, cut, 5, "step_000003")
    assert all(torch.equal(again[k], off[k]) for k in off)
    assert [row["reward_mean"] for row in metrics(cut)] == [
        row["reward_mean"] for row in metrics(tmp_path / "always")]


def sharing(allocations: dict) -> set[frozenset[str]]:
    """The sets of calls that run on the same mesh."""
    by_mesh: dict[tuple, set[str]] = {}
    for name, a in allocations.items():
        by_mesh.setdefault((a["mesh"]["first_gpu"], a["mesh"]["n_gpus"]), set()).add(name)
    return {frozenset(v) for v in by_mesh.values()}
