"""Search checked against brute force (STYLE rule 10).

Random small instances (algorithm, models, batch shape, cluster of at most 16 GPUs,
a random subset of the meshes so the space stays at most 3000 assignments; half of
them with a memory limit that many assignments overflow) are solved by trying every
assignment with planner.search.simulator.simulate; branch and bound must return the same
optimal iteration time, exactly. search() must reach it too, and is never slower
than a heuristic.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import random

import pytest

from planner.cost.cost_config import CostModelConfig
from planner.cost.cost_model import CostModel
from planner.errors import PlanError
from planner.graph.algorithms import ALGORITHMS as SPECS
from planner.graph.algorithms import BatchShape, build_graph
from planner.search.exact import branch_and_bound
from planner.search.heuristics import HEURISTICS
from planner.search.problem import Problem, RoleModel, build_problem, head_of
from planner.search.search import SearchSettings, search
from planner.search.simulator import ReallocCache, simulate
from planner.specs.cluster import ClusterSpec, resolve_device
from planner.specs.mesh import enumerate_meshes
from planner.specs.model_spec import model_presets

pytestmark = pytest.mark.pure

N_INSTANCES = 40
MAX_SPACE = 3000
ALGORITHMS = ("ppo", "grpo", "remax", "rloo", "reinforce_pp", "dpo", "sft", "rm")
CLUSTERS = ((1, 2), (1, 4), (2, 2), (1, 8), (2, 4), (2, 8), (4, 4))
MODELS = ("tiny-llama", "tiny-qwen", "tiny-llama-8l", "llama2-7b")


def random_instance(rng: random.Random) -> Problem:
    presets = model_presets()
    while True:
        alg = rng.choice(ALGORITHMS)
        roles = set(SPECS[alg].required_roles) | ({"ref"} & set(SPECS[alg].optional_roles))
        if alg in ("grpo", "remax", "rloo") and rng.random() < 0.5:
            roles.add("reward")
        n_nodes, gpn = rng.choice(CLUSTERS)
        cluster = ClusterSpec(n_nodes=n_nodes, gpus_per_node=gpn,
                              device=resolve_device(rng.choice(("a100-80g", "h100-80g"))))
        shape = BatchShape(prompts_per_step=rng.choice((2, 4, 8)),
                           samples_per_prompt=rng.choice((1, 2)),
                           prompt_len=rng.choice((16, 64)), gen_len=rng.choice((16, 64)),
                           ppo_minibatches=rng.choice((1, 2)), ppo_epochs=1)
        models = {r: RoleModel(r, presets[rng.choice(MODELS)], head_of(r)) for r in roles}
        meshes = enumerate_meshes(cluster)
        subset = rng.sample(meshes, min(len(meshes), rng.randint(2, 4)))
        try:
            # training-state offload and recompute would multiply the train candidates
            # past MAX_SPACE (candidates are what branch and bound is checked over, not
            # how priced)
            cost = CostModel(cluster, CostModelConfig(train_state_offload="never",
                                                      recompute="never"))
            prob = build_problem(build_graph(alg, shape, roles), models, cost,
                                 n_iters=rng.randint(1, 3), meshes=subset)
        except PlanError:
            continue
        if 30 <= prob.space_size() <= MAX_SPACE:
            return prob


def tighten(prob: Problem, rng: random.Random) -> Problem:
    """The same problem with a limit that about half of random assignments overflow."""
    peaks = sorted(max(simulate(prob, [rng.randrange(len(c)) for c in prob.cands]).peak_bytes)
                   for _ in range(16))
    return dataclasses.replace(prob, mem_limit_bytes=peaks[8])


def brute_force(prob: Problem) -> tuple[float, int]:
    """(best feasible iteration time or inf, number of feasible assignments)."""
    cache = ReallocCache(prob)
    best, n_feasible = math.inf, 0
    for a in itertools.product(*(range(len(c)) for c in prob.cands)):
        r = simulate(prob, list(a), cache)
        if r.feasible:
            n_feasible += 1
            best = min(best, r.iter_time_s)
    return best, n_feasible


@pytest.fixture(scope="module")
def instances() -> list[tuple[Problem, float, int]]:
    out = []
    for k in range(N_INSTANCES):
        rng = random.Random(14000 + k)   # a seed range that draws all 8 algorithms
        prob = random_instance(rng)
        if k % 2:
            prob = tighten(prob, rng)
        out.append((prob, *brute_force(prob)))
    return out


def test_instances_are_varied(instances):
    probs = [p for p, _, _ in instances]
    assert len({p.graph.algorithm for p in probs}) >= 6
    assert any(p.n_gpus == 16 for p in probs) and any(p.n_gpus == 2 for p in probs)
    assert sum(0 < nf < p.space_size() for p, _, nf in instances) >= 10   # memory binds
    assert any(any(t >= 0 for t in p.model_train_mfc) and len(p.cands) >= 4 for p in probs)


def test_branch_and_bound_equals_brute_force(instances):
    for k, (prob, best, n_feasible) in enumerate(instances):
        r = branch_and_bound(prob)
        assert r.complete
        assert r.iter_time_s == best, (k, prob.graph.algorithm, r.iter_time_s, best)
        if n_feasible:
            assert r.assign is not None
            res = simulate(prob, r.assign)
            assert res.feasible and res.iter_time_s == best
        else:
            assert r.assign is None


def test_branch_and_bound_from_a_feasible_incumbent(instances):
    """Seeding with any feasible assignment changes nothing about the optimum."""
    rng = random.Random(3)
    for prob, best, n_feasible in instances[:20]:
        if not n_feasible:
            continue
        while True:
            a = [rng.randrange(len(c)) for c in prob.cands]
            if simulate(prob, a).feasible:
                break
        assert branch_and_bound(prob, incumbent=a).iter_time_s == best


def experiment(alg, roles, n_nodes, gpn, model, shape):
    cluster = ClusterSpec(n_nodes=n_nodes, gpus_per_node=gpn, device=resolve_device("a100-80g"))
    presets = model_presets()
    models = {r: RoleModel(r, presets[model], head_of(r)) for r in roles}
    return build_graph(alg, shape, set(roles)), models, cluster


def test_search_exact_reaches_the_brute_force_optimum():
    graph, models, cluster = experiment(
        "grpo", ("actor", "ref"), 1, 2, "tiny-llama",
        BatchShape(prompts_per_step=4, prompt_len=16, gen_len=16, ppo_minibatches=1))
    settings = SearchSettings(method="exact", n_iters=3)
    cfg = CostModelConfig(optimizer_offload="never",     # a space brute force can walk
                          train_state_offload="never", recompute="never")
    prob = build_problem(graph, models, CostModel(cluster, cfg), n_iters=settings.n_iters)
    assert 100 <= prob.space_size() <= MAX_SPACE     # search sees the whole mesh space
    best, n_feasible = brute_force(prob)
    assert n_feasible > 0
    plan = search("exact-check", graph, models, cluster, cfg, settings=settings)
    assert plan.search.method == "exact" and plan.search.complete
    assert plan.iteration_time_s == best
    # the optimum here is strictly better than the best hand-written plan
    heur = [h.iteration_time_s for h in plan.heuristics if h.iteration_time_s is not None]
    assert heur and best < min(heur)


@pytest.mark.parametrize("alg,roles,n_nodes,gpn,model,shape,method", [
    ("dpo", ("actor", "ref"), 1, 2, "tiny-llama",
     BatchShape(prompts_per_step=4, prompt_len=16, gen_len=16, ppo_minibatches=1), "auto"),
    ("ppo", ("actor", "critic", "ref", "reward"), 2, 4, "tiny-llama",
     BatchShape(prompts_per_step=8, prompt_len=64, gen_len=64, ppo_minibatches=2), "anneal"),
    ("grpo", ("actor", "ref", "reward"), 1, 8, "llama2-7b",
     BatchShape(prompts_per_step=64, prompt_len=128, gen_len=256, ppo_minibatches=2), "auto"),
])
def test_search_is_never_slower_than_a_heuristic(alg, roles, n_nodes, gpn, model, shape,
                                                  method):
    graph, models, cluster = experiment(alg, roles, n_nodes, gpn, model, shape)
    plan = search("vs-heuristics", graph, models, cluster,
                  settings=SearchSettings(method=method, time_limit_s=5.0, anneal_steps=20000,
                                          exact_max_space=3000))
    assert {h.name for h in plan.heuristics} == set(HEURISTICS)
    heur = [h.iteration_time_s for h in plan.heuristics if h.iteration_time_s is not None]
    assert heur, "no heuristic fits: the comparison would be empty"
    assert all(plan.iteration_time_s <= t for t in heur)
    # and the plan's own numbers are what the simulator says of its allocations
    assert max(plan.peak_mem_bytes) <= plan.mem_limit_bytes
