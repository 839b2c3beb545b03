"""The annealing search does not depend on its seed where the optimum is known.

Small instances (those of test_exact: random algorithms, models, clusters of at most 16
GPUs and mesh subsets, half of them with a memory limit that many plans overflow) are
solved by brute force; ``search(method="anneal")`` with seeds 0-7 must return that
optimum every time. And the polish climbs out of the trap seen on PPO: two trainings on
the whole node where the faster plan puts them on its two halves, which only a move of
three or four calls at once reaches (every smaller part of it overflows memory).
"""
from __future__ import annotations

import math
import random

import pytest

import planner.search.search as search_mod
from planner.cost.cost_config import CostModelConfig
from planner.cost.cost_model import CostModel
from planner.graph.algorithms import BatchShape, build_graph
from planner.search.core_bridge import CoreSimulator
from planner.search.polish import polish
from planner.search.problem import Problem, RoleModel, build_problem, head_of
from planner.search.search import SearchSettings, _search, random_starts
from planner.search.simulator import energy, simulate
from planner.specs.cluster import ClusterSpec, resolve_device
from planner.specs.mesh import enumerate_meshes
from planner.specs.model_spec import model_presets
from tests.planner.test_exact import brute_force, random_instance, tighten

pytestmark = pytest.mark.pure

SEEDS = range(8)


def search_problem(prob: Problem, seed: int, monkeypatch: pytest.MonkeyPatch) -> float:
    """The annealing search's best iteration time on ``prob`` (the instance as drawn,
    its mesh subset and memory limit included)."""
    monkeypatch.setattr(search_mod, "build_problem", lambda *a, **k: prob)
    settings = SearchSettings(method="anneal", seed=seed, n_iters=prob.n_iters, time_limit_s=60)
    plan = _search("seeds", prob.graph, {m.role: m for m in prob.models}, prob.cluster,
                   settings=settings)
    assert plan.search.method == "anneal"
    return plan.iteration_time_s


@pytest.mark.parametrize("k", [0, 1, 3, 4, 7, 8])
def test_every_seed_reaches_the_brute_force_optimum(k, monkeypatch):
    rng = random.Random(14000 + k)
    prob = random_instance(rng)
    if k % 2:
        prob = tighten(prob, rng)
    best, n_feasible = brute_force(prob)
    if not n_feasible:
        pytest.skip("nothing fits")
    found = [search_problem(prob, seed, monkeypatch) for seed in SEEDS]
    assert found == [pytest.approx(best, rel=1e-12)] * len(found), (best, found)


def test_random_starts_are_the_seeds_and_lie_in_the_space():
    prob = random_instance(random.Random(14000))
    a, b = random_starts(prob, 3, 5), random_starts(prob, 3, 6)
    assert a == random_starts(prob, 3, 5) and a != b
    assert all(0 <= j < len(cs) for s in a for j, cs in zip(s, prob.cands))


def ppo_8gpu() -> Problem:
    presets = model_presets()
    cluster = ClusterSpec(n_nodes=1, gpus_per_node=8, device=resolve_device("h100-80g"))
    roles = ("actor", "critic", "ref", "reward")
    models = {r: RoleModel(r, presets["llama2-7b"], head_of(r)) for r in roles}
    graph = build_graph("ppo", BatchShape(prompts_per_step=64, prompt_len=128, gen_len=256,
                                          ppo_minibatches=2), set(roles))
    meshes = [m for m in enumerate_meshes(cluster) if m.n_gpus >= 4]
    cfg = CostModelConfig(optimizer_offload="never", train_state_offload="never",
                          recompute="never")
    return build_problem(graph, models, CostModel(cluster, cfg), n_iters=2, meshes=meshes)


def test_polish_never_worsens_and_is_a_fixed_point():
    prob = ppo_8gpu()
    sim = CoreSimulator(prob)
    rng = random.Random(1)
    for _ in range(3):
        while True:
            start = [rng.randrange(len(c)) for c in prob.cands]
            if sim(start).feasible:
                break
        a, e = polish(prob, sim, start)
        res = simulate(prob, a)
        assert res.feasible and energy(prob, res) == e <= energy(prob, simulate(prob, start))
        # nothing of its neighbourhood improves on where it stops
        assert polish(prob, sim, a) == (a, e)
        assert math.isfinite(e)


def ppo_7b_a100() -> Problem:
    """The shape of experiments/ppo-llama2-7b-8gpu.yaml on meshes of 4 and 8 GPUs: its
    walks end in plans with both trainings on the whole node and two scoring calls on
    its halves, or the trainings on the halves and the scoring calls on the whole node,
    joined only by a change of four calls."""
    presets = model_presets()
    cluster = ClusterSpec(n_nodes=1, gpus_per_node=8, device=resolve_device("a100-80g"))
    roles = ("actor", "critic", "ref", "reward")
    models = {r: RoleModel(r, presets["llama2-7b"], head_of(r)) for r in roles}
    graph = build_graph("ppo", BatchShape(prompts_per_step=512, prompt_len=128, gen_len=384,
                                          ppo_minibatches=4), set(roles))
    meshes = [m for m in enumerate_meshes(cluster) if m.n_gpus >= 4]
    return build_problem(graph, models, CostModel(cluster, CostModelConfig()), n_iters=2,
                         meshes=meshes)


def test_every_seed_joins_the_ppo_trap(monkeypatch):
    prob = ppo_7b_a100()
    plans = []
    for seed in SEEDS:
        monkeypatch.setattr(search_mod, "build_problem", lambda *a, **k: prob)
        settings = SearchSettings(method="anneal", seed=seed, n_iters=2, time_limit_s=120)
        plans.append(_search("trap", prob.graph, {m.role: m for m in prob.models},
                             prob.cluster, settings=settings))
    times = [p.iteration_time_s for p in plans]
    assert times == [pytest.approx(times[0], rel=1e-12)] * len(times), times
    # the faster of the two: each training on its own half of the node
    for p in plans:
        train = sorted((a.mesh.first_gpu, a.mesh.n_gpus) for a in p.allocations
                       if a.kind == "train")
        assert train == [(0, 4), (4, 4)], p.allocations
