"""The execution plan is data: it round-trips through JSON without loss, is versioned,
and bad files or clusters that are too small give errors that say what to do."""
from __future__ import annotations

import json

import pytest

from planner.cost.cost_config import CostModelConfig
from planner.cost.cost_model import CostModel
from planner.errors import InfeasibleError, PlanError
from planner.graph.algorithms import BatchShape, build_graph
from planner.plan import PLAN_SCHEMA_VERSION, ExecutionPlan, SearchInfo
from planner.search.heuristics import openrlhf
from planner.search.plan_build import build_plan
from planner.search.problem import RoleModel, build_problem, head_of
from planner.search.search import SearchSettings, search
from planner.specs.cluster import ClusterSpec, resolve_device
from planner.specs.model_spec import model_presets

pytestmark = pytest.mark.pure

FAST = SearchSettings(time_limit_s=2.0, anneal_steps=5000)


def experiment(alg, roles, model, n_nodes, gpn, shape=None):
    shape = shape or BatchShape(prompts_per_step=8, prompt_len=64, gen_len=64,
                                ppo_minibatches=1)
    presets = model_presets()
    models = {r: RoleModel(r, presets[model], head_of(r)) for r in roles}
    cluster = ClusterSpec(n_nodes=n_nodes, gpus_per_node=gpn, device=resolve_device("a100-80g"))
    return build_graph(alg, shape, set(roles)), models, cluster


@pytest.fixture(scope="module")
def plan() -> ExecutionPlan:
    graph, models, cluster = experiment("ppo", ("actor", "critic", "ref", "reward"),
                                        "tiny-llama", 2, 2)
    return search("ppo-tiny", graph, models, cluster, settings=FAST)


def test_round_trip_is_lossless(plan):
    text = plan.to_json()
    back = ExecutionPlan.from_json(text)
    assert back == plan
    assert back.to_json() == text
    assert back.allocation("actor.train") == plan.allocation("actor.train")
    calls = [e for e in plan.timeline if e.kind not in ("realloc", "send")]
    assert len(calls) == len(plan.graph.mfcs) * plan.n_iters


def test_round_trip_through_a_file(plan, tmp_path):
    p = tmp_path / "plan.json"
    p.write_text(plan.to_json())
    assert ExecutionPlan.load(p) == plan


def test_round_trip_with_reallocations():
    """An openrlhf plan generates on other GPUs than it trains, so the actor moves
    every iteration: Reallocation entries survive the round trip too."""
    graph, models, cluster = experiment("grpo", ("actor", "ref"), "tiny-llama-8l", 1, 4)
    cfg = CostModelConfig()
    prob = build_problem(graph, models, CostModel(cluster, cfg))
    assign = openrlhf(prob)
    info = SearchInfo(method="manual", seed=0, search_time_s=0.0,
                      space_size=float(prob.space_size()), candidates={}, steps=0,
                      complete=False)
    p = build_plan("ds", prob, assign, cfg, info, ())
    assert p.reallocations and p.reallocations[0].bytes > 0
    assert ExecutionPlan.from_json(p.to_json()) == p


def test_schema_version_is_in_the_file(plan):
    raw = json.loads(plan.to_json())
    assert raw["schema_version"] == PLAN_SCHEMA_VERSION == 15


def test_a_wrong_version_is_rejected(plan):
    raw = json.loads(plan.to_json())
    raw["schema_version"] = 1
    with pytest.raises(PlanError, match="has schema_version 1; this realign reads 15") as e:
        ExecutionPlan.from_json(json.dumps(raw), source="old.json")
    assert e.value.field == "plan" and "old.json" in str(e.value)


@pytest.mark.parametrize("mutate,snippet", [
    (lambda raw: raw.pop("allocations"), "allocations: Field required"),
    (lambda raw: raw.update(surprise=1), "surprise: Extra inputs are not permitted"),
    (lambda raw: raw["allocations"][0].update(micro_batches="many"),
     "allocations.0.micro_batches"),
    (lambda raw: raw["cluster"].update(n_nodes=0), "cluster.n_nodes"),
])
def test_a_malformed_plan_names_the_problem(plan, mutate, snippet):
    raw = json.loads(plan.to_json())
    mutate(raw)
    with pytest.raises(PlanError, match="plan.json is not a valid execution plan") as e:
        ExecutionPlan.from_json(json.dumps(raw), source="plan.json")
    assert snippet in str(e.value) and e.value.field == "plan"


def _realloc_plan():
    """Generation on GPUs 0-1 at TP2, the reference on GPU 2, training on GPUs 2-3 at
    DP2 (fixed by hand: what the cases below break must not move with the costs)."""
    from planner.search.manual import manual_plan
    from planner.specs.layout import Allocation, Layout
    from planner.specs.mesh import DeviceMesh
    graph, models, cluster = experiment("grpo", ("actor", "ref"), "tiny-llama-8l", 1, 4)
    allocs = {"actor.generate": Allocation(mesh=DeviceMesh(first_gpu=0, n_gpus=2),
                                           layout=Layout(tp=2), micro_batches=1),
              "ref.inference": Allocation(mesh=DeviceMesh(first_gpu=2, n_gpus=1),
                                          layout=Layout(), micro_batches=1),
              "actor.train": Allocation(mesh=DeviceMesh(first_gpu=2, n_gpus=2),
                                        layout=Layout(dp=2), micro_batches=1)}
    return manual_plan("ds", graph, models, cluster, allocs, CostModelConfig())


def _alloc(raw, name):
    return next(a for a in raw["allocations"] if a["mfc"] == name)


@pytest.mark.parametrize("mutate,snippet", [
    (lambda raw: _alloc(raw, "actor.train")["mesh"].update(first_gpu=8),
     "allocation actor.train: mesh GPUs 8..9 exceed the cluster's 4 GPUs"),
    (lambda raw: _alloc(raw, "actor.train")["layout"].update(dp=1),
     "allocation actor.train: tp*pp*dp = 1 but the mesh has 2 GPUs"),
    (lambda raw: _alloc(raw, "actor.train").update(micro_batches=3),
     "allocation actor.train: micro_batches=3 must divide"),
    (lambda raw: _alloc(raw, "actor.train").update(mfc="actor.trian"),
     "its allocations are for"),
    (lambda raw: _alloc(raw, "actor.train").update(kind="inference"),
     "allocation actor.train is a actor inference call"),
    (lambda raw: _alloc(raw, "actor.train").update(mesh_name="n7"),
     "mesh_name 'n7' is not its mesh's name"),
    (lambda raw: raw.update(reallocations=[]), "it lists the reallocations []"),
    (lambda raw: raw["reallocations"][0]["src_layout"].update(tp=4, dp=1),
     "the reallocation of actor to actor.generate goes TP4"),
])
def test_an_inconsistent_plan_is_refused_and_says_why(mutate, snippet):
    """What the run executes must be what the plan says: allocations for exactly the
    graph's MFCs, valid on the cluster, and exactly the reallocations they imply."""
    raw = json.loads(_realloc_plan().to_json())
    mutate(raw)
    with pytest.raises(PlanError, match="plan.json is not a consistent execution plan") as e:
        ExecutionPlan.from_json(json.dumps(raw), source="plan.json")
    assert snippet in str(e.value) and e.value.field == "plan"


def test_not_json_and_no_file(tmp_path):
    with pytest.raises(PlanError, match="not a valid execution plan"):
        ExecutionPlan.from_json("{not json", source="x.json")
    with pytest.raises(PlanError, match="no plan file at") as e:
        ExecutionPlan.load(tmp_path / "missing.json")
    assert e.value.field == "plan"


# ---- clusters that are too small ------------------------------------------------------

@pytest.mark.parametrize("alg,roles,model,gpn,says,n_fit", [
    # (llama2-7b SFT fits on one A100 with its optimizer state offloaded; 13B does not)
    ("sft", ("actor",), "llama2-13b", 1, "actor.train (llama2-13b, ", 2),
    ("grpo", ("actor", "ref"), "llama2-13b", 1, "actor.train (llama2-13b, ", 3),
    ("ppo", ("actor", "critic", "ref", "reward"), "llama2-13b", 2,
     "GPU 0 needs", 2),
])
def test_infeasible_names_what_does_not_fit_and_a_cluster_that_does(alg, roles, model, gpn,
                                                                     says, n_fit):
    graph, models, cluster = experiment(alg, roles, model, 1, gpn)
    with pytest.raises(InfeasibleError) as e:
        search("too-small", graph, models, cluster, settings=FAST)
    msg = str(e.value)
    assert e.value.field == "cluster"
    assert says in msg and "72.0 GiB per GPU" in msg
    assert (f"The smallest cluster that fits: {n_fit} nodes x {gpn} a100-80g "
            f"({n_fit * gpn} GPUs)") in msg
    # the suggestion is right: it fits there, and on no smaller cluster of this kind
    bigger = cluster.model_copy(update={"n_nodes": n_fit})
    fitted = search("fits", graph, models, bigger, settings=FAST)
    assert max(fitted.peak_mem_bytes) <= fitted.mem_limit_bytes
    for n in range(2, n_fit):
        with pytest.raises(InfeasibleError):
            search("still-too-small", graph, models,
                   cluster.model_copy(update={"n_nodes": n}), settings=FAST)
