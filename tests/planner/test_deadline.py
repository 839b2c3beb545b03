"""plan.time_limit_s bounds planning on the wall clock, set-up included, and a search
that runs out of time keeps the best seed instead of calling the problem infeasible."""
from __future__ import annotations

import pytest

from planner.cost.cost_model import CostModel
from planner.errors import PlanError
from planner.graph.algorithms import BatchShape, build_graph
from planner.search import search as search_mod
from planner.search.deadline import Deadline
from planner.search.problem import RoleModel, build_problem, head_of
from planner.search.search import SearchSettings, search
from planner.specs.cluster import MAX_NODES, ClusterSpec, resolve_device
from planner.specs.model_spec import model_presets

pytestmark = pytest.mark.pure

ROLES = ("actor", "critic", "ref", "reward")


def ppo(n_nodes: int):
    spec = model_presets()["llama2-7b"]
    models = {r: RoleModel(r, spec, head_of(r)) for r in ROLES}
    graph = build_graph("ppo", BatchShape(prompts_per_step=64, gen_len=128), set(ROLES))
    return graph, models, ClusterSpec(n_nodes=n_nodes, gpus_per_node=8,
                                      device=resolve_device("h100-80g"))


def test_a_passed_deadline_stops_the_set_up_and_names_the_setting():
    graph, models, cluster = ppo(4)
    gone = Deadline(end=0.0, limit_s=0.5)
    with pytest.raises(PlanError, match="ran past plan.time_limit_s = 0.5 s while pricing") as e:
        build_problem(graph, models, CostModel(cluster), deadline=gone)
    assert e.value.field == "plan.time_limit_s"
    with pytest.raises(PlanError) as e:
        search("t", graph, models, ppo(MAX_NODES)[2],
               settings=SearchSettings(time_limit_s=0.01))
    assert e.value.field == "plan.time_limit_s"


def test_out_of_search_time_keeps_the_best_seed(monkeypatch):
    graph, models, cluster = ppo(2)
    settings = SearchSettings(method="anneal", time_limit_s=30)
    monkeypatch.setattr(search_mod, "_anneal", lambda *a: (None, float("inf"), 0, False))
    plan = search("t", graph, models, cluster, settings=settings)
    fitting = [h.iteration_time_s for h in plan.heuristics if h.iteration_time_s is not None]
    assert fitting and plan.iteration_time_s == pytest.approx(min(fitting))


def test_heuristics_past_the_deadline_are_reported_not_evaluated():
    graph, models, cluster = ppo(2)
    prob = build_problem(graph, models, CostModel(cluster))
    plans, skipped = search_mod._heuristics(prob, Deadline(end=0.0, limit_s=1.0))
    assert skipped == set(plans) and all(a is None for a in plans.values())


def test_the_cluster_size_is_bounded_in_the_schema():
    with pytest.raises(ValueError, match=f"less than or equal to {MAX_NODES}"):
        ClusterSpec(n_nodes=MAX_NODES + 1, gpus_per_node=8, device=resolve_device("cpu"))
