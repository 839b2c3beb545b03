"""Multi-turn generate calls in the planner: the turns' shapes, their price (more
turns and longer observations cost more; other groups' decoding hides the
environment's time), the plan's JSON, table and SVG."""
from __future__ import annotations

import pytest

from planner.cost.cost_model import CostModel
from planner.graph.algorithms import BatchShape, build_graph
from planner.graph.turns import Turns
from planner.plan import ExecutionPlan
from planner.report import table
from planner.search.problem import RoleModel, head_of
from planner.search.search import SearchSettings, search
from planner.specs.cluster import ClusterSpec, resolve_device
from planner.specs.layout import Layout
from planner.specs.mesh import DeviceMesh
from planner.specs.model_spec import model_presets
from planner.timeline_svg import render

pytestmark = pytest.mark.pure

SHAPE = BatchShape(prompts_per_step=8, samples_per_prompt=4, prompt_len=16, gen_len=64,
                   ppo_minibatches=1)


def test_turn_shapes_grow_the_context_and_stop_at_the_budget():
    t = Turns(turns=3, turn_tokens=20, obs_tokens=10)
    assert t.turn_shapes(16, 64) == [(1.0, 16, 20), (1.0, 46, 20), (1.0, 76, 4)]
    assert Turns(turns=5, turn_tokens=30, obs_tokens=30).turn_shapes(16, 64) == \
        [(1.0, 16, 30), (1.0, 76, 4)]


def _gen(turns: Turns | None):
    graph = build_graph("grpo", SHAPE, {"actor"}, turns=turns)
    return next(m for m in graph.mfcs if m.kind == "generate"), graph


def _price(turns):
    spec = model_presets()["tiny-llama"]
    cost = CostModel(ClusterSpec(n_nodes=1, gpus_per_node=1, device=resolve_device("a100-80g")))
    mfc, _ = _gen(turns)
    return cost.mfc_cost(mfc, spec, "lm", DeviceMesh(first_gpu=0, n_gpus=1),
                         Layout(tp=1, pp=1, dp=1), 1)


def test_more_turns_and_observations_cost_more_and_groups_hide_the_environment():
    one = _price(None)                                        # 64 tokens in one call
    split = _price(Turns(turns=2, turn_tokens=32, obs_tokens=0))   # the same, in two
    # the same tokens decoded (a second prefill, one decode step fewer per call)
    assert split.time_s == pytest.approx(one.time_s, rel=0.1) and split.time_s != one.time_s
    two = _price(Turns(turns=2, turn_tokens=16, obs_tokens=8))
    three = _price(Turns(turns=3, turn_tokens=16, obs_tokens=8))
    assert three.time_s > two.time_s
    assert three.activation_bytes > two.activation_bytes     # the longest context's cache
    slow_env = _price(Turns(turns=2, turn_tokens=32, obs_tokens=8, env_s=1.0))
    assert slow_env.terms_s["env_wait"] == pytest.approx(2.0)
    grouped = _price(Turns(turns=2, turn_tokens=32, obs_tokens=8, env_s=1.0, groups=2))
    per_group_turn = (grouped.time_s - grouped.terms_s["env_wait"]) / 4
    assert grouped.terms_s["env_wait"] == pytest.approx(2 * (1.0 - per_group_turn))
    hidden = _price(Turns(turns=2, turn_tokens=32, obs_tokens=8, env_s=1e-9, groups=2))
    assert hidden.terms_s["env_wait"] == 0.0


def test_a_plan_with_turns_round_trips_and_shows_them():
    turns = Turns(turns=2.5, turn_tokens=24, obs_tokens=6, env_s=0.05, groups=2)
    _, graph = _gen(turns)
    presets = model_presets()
    models = {"actor": RoleModel("actor", presets["tiny-llama"], head_of("actor"))}
    cluster = ClusterSpec(n_nodes=1, gpus_per_node=2, device=resolve_device("a100-80g"))
    plan = search("tools", graph, models, cluster,
                  settings=SearchSettings(time_limit_s=2.0, anneal_steps=2000))
    assert ExecutionPlan.from_json(plan.to_json()) == plan
    assert plan.graph.mfc("actor.generate").turns == turns
    text = table(plan)
    assert "actor.generate: 2.5 turns of <= 24 tokens, 6-token observations, 0.05 s " \
           "environment per turn, 2 group(s) taking turns" in text
    svg = render(plan)
    assert "[own, 2.5 turns]" in svg                       # the bars' titles
    assert "actor.generate: 2.5 turns of &lt;= 24 tokens" in svg   # a note under the lanes
