"""Host work outside the calls, priced: realign's own time between steps (a profile's
:class:`StepCosts` per worker) and the batch every worker prepares (twice in an
asynchronous step) between iterations; the rule reward scoring every generated
sequence after its generation."""
from __future__ import annotations

from dataclasses import replace

import pytest

from planner.cost.cost_config import CostModelConfig
from planner.cost.cost_model import CostModel
from planner.cost.profile import ProfileTable, StepCosts
from planner.graph.algorithms import BatchShape, build_graph
from planner.search.manual import manual_plan
from planner.search.problem import RoleModel, build_problem, head_of, host_s, step_overhead_s
from planner.search.simulator import simulate
from planner.specs.cluster import ClusterSpec, resolve_device
from planner.specs.layout import Allocation, Layout
from planner.specs.mesh import DeviceMesh
from planner.specs.model_spec import model_presets

pytestmark = pytest.mark.pure

SHAPE = BatchShape(prompts_per_step=16, samples_per_prompt=4, prompt_len=8, gen_len=64,
                   ppo_minibatches=1)
CPU2 = ClusterSpec(n_nodes=1, gpus_per_node=2, device=resolve_device("cpu"))
ACTOR = {"actor": RoleModel("actor", model_presets()["tiny-llama"], head_of("actor"))}


def test_step_costs_grow_with_the_workers():
    s = StepCosts(fixed_s=1e-4, per_worker_s=4e-4)
    assert s.time_s(1) == pytest.approx(5e-4) and s.time_s(2) == pytest.approx(9e-4)


@pytest.mark.parametrize("asynchronous, expected", [(False, 9e-4 + 3e-4),
                                                    (True, 9e-4 + 2 * 3e-4)])
def test_the_step_overhead_is_realigns_own_plus_each_batch(asynchronous, expected):
    """2 workers at 1e-4 + 4e-4 each, a batch of 3e-4 s; an asynchronous step prepares
    its own batch and the next one's."""
    graph = build_graph("grpo", SHAPE, {"actor"}, max_staleness=1, asynchronous=asynchronous)
    table = ProfileTable(device="cpu", step=StepCosts(fixed_s=1e-4, per_worker_s=4e-4))
    cost = CostModel(CPU2, CostModelConfig(batch_s=3e-4), table)
    assert step_overhead_s(graph, cost) == pytest.approx(expected)


def test_no_profile_and_no_batch_time_price_nothing_between_steps():
    graph = build_graph("grpo", SHAPE, {"actor"})
    assert step_overhead_s(graph, CostModel(CPU2)) == 0.0


def test_each_iteration_pays_the_overhead_once():
    """Same assignment, 3 iterations: 0.25 s between steps adds exactly 0.25 s to the
    iteration time, and each iteration starts that much after the previous one ends."""
    graph = build_graph("grpo", SHAPE, {"actor"})
    prob = build_problem(graph, ACTOR, CostModel(CPU2), n_iters=3)
    assign = [0] * len(prob.cands)
    base = simulate(prob, assign, record=True)
    more = simulate(replace(prob, step_overhead_s=0.25), assign, record=True)
    assert more.iter_time_s == pytest.approx(base.iter_time_s + 0.25)
    first = {e.iteration: e.start_s for e in more.events[::-1]}
    assert first[0] == pytest.approx(0.25)
    assert first[1] == pytest.approx(base.iter_time_s + 0.5)


def test_the_rule_reward_scores_every_generated_sequence_after_the_generation():
    """64 sequences at 8 us each: 5.12e-4 s on the generation, nothing on other calls,
    nothing with a reward model (no rule reward)."""
    cfg = CostModelConfig(reward_s_per_seq=8e-6)
    graph = build_graph("grpo", SHAPE, {"actor"})
    gen, train = graph.mfcs[0], graph.mfcs[-1]
    assert gen.kind == "generate" and gen.n_seqs == 64
    assert host_s(graph, gen, cfg) == pytest.approx(5.12e-4)
    assert host_s(graph, train, cfg) == 0.0
    with_rm = build_graph("grpo", SHAPE, {"actor", "reward"})
    assert host_s(with_rm, with_rm.mfcs[0], cfg) == 0.0
    plain = build_problem(graph, ACTOR, CostModel(CPU2))
    scored = build_problem(graph, ACTOR, CostModel(CPU2, cfg))
    assert [c.time_s for c in scored.cands[0]] == pytest.approx(
        [c.time_s + 5.12e-4 for c in plain.cands[0]])
    assert [c.time_s for c in scored.cands[-1]] == [c.time_s for c in plain.cands[-1]]


def test_a_hand_written_plan_prices_the_same_host_work():
    cfg = CostModelConfig(reward_s_per_seq=8e-6)
    graph = build_graph("grpo", SHAPE, {"actor"})
    alloc = Allocation(mesh=DeviceMesh(first_gpu=0, n_gpus=2), layout=Layout(tp=1, pp=1, dp=2))
    allocs = {m.name: alloc for m in graph.mfcs}
    plain = manual_plan("p", graph, ACTOR, CPU2, allocs, CostModelConfig())
    scored = manual_plan("p", graph, ACTOR, CPU2, allocs, cfg)
    assert scored.iteration_time_s == pytest.approx(plain.iteration_time_s + 5.12e-4)
