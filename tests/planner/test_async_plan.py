"""Asynchronous plans: the graph (generation one step ahead, the proximal policy's
scoring), the simulator's steady-state price (the slower side plus the weight
transfer, not the sum), the search dividing the cluster, and both modes side by side."""
from __future__ import annotations

import pytest

from planner.cost.cost_model import CostModel
from planner.errors import PlanError
from planner.graph.algorithms import BatchShape, build_graph
from planner.graph.proximal import PROXIMAL_MFC
from planner.report import async_speedup, modes_lines, table
from planner.search.problem import RoleModel, async_splits, build_problem, head_of
from planner.search.search import SearchSettings, search
from planner.search.simulator import ReallocCache, simulate
from planner.specs.cluster import ClusterSpec, resolve_device
from planner.specs.model_spec import model_presets

pytestmark = pytest.mark.pure

SHAPE = BatchShape(prompts_per_step=16, samples_per_prompt=4, prompt_len=8, gen_len=64,
                   ppo_minibatches=1)
CPU2 = ClusterSpec(n_nodes=1, gpus_per_node=2, device=resolve_device("cpu"))


def models(*roles):
    tiny = model_presets()["tiny-llama"]
    return {r: RoleModel(r, tiny, head_of(r)) for r in roles}


def test_the_asynchronous_graph_scores_the_rollout_with_the_current_policy():
    sync = build_graph("grpo", SHAPE, {"actor"}, max_staleness=1)
    asyn = build_graph("grpo", SHAPE, {"actor"}, max_staleness=1, asynchronous=True)
    assert [m.name for m in sync.mfcs] == ["actor.generate", "actor.train"]
    assert [m.name for m in asyn.mfcs] == ["actor.generate", PROXIMAL_MFC, "actor.train"]
    assert asyn.mfc("actor.train").input_keys[-1] == "prox_logprobs"
    assert [asyn.is_ahead(m) for m in asyn.mfcs] == [True, False, False]
    assert not any(sync.is_ahead(m) for m in sync.mfcs)
    assert (sync.max_staleness, sync.ahead_steps, asyn.ahead_steps) == (1, 0, 1)
    ppo = build_graph("ppo", SHAPE, {"actor", "critic", "reward", "ref"}, max_staleness=2,
                      asynchronous=True)
    assert "prox_logprobs" not in ppo.mfc("critic.train").input_keys


def test_asynchronous_graphs_are_refused_where_they_make_no_sense():
    with pytest.raises(PlanError) as e:
        build_graph("grpo", SHAPE, {"actor"}, asynchronous=True)      # bound 0
    assert e.value.field == "algorithm.max_staleness"
    with pytest.raises(PlanError) as e:
        build_graph("dpo", SHAPE, {"actor", "ref"}, max_staleness=1, asynchronous=True)
    assert e.value.field == "algorithm.max_staleness"


def _problem(split=None):
    graph = build_graph("grpo", SHAPE, {"actor"}, max_staleness=1, asynchronous=True)
    return build_problem(graph, models("actor"), CostModel(CPU2), n_iters=2, split=split)


def _pick(prob, i, first, n):
    return min((j for j, c in enumerate(prob.cands[i]) if (c.first_gpu, c.n_gpus) == (first, n)),
               key=lambda j: prob.cands[i][j].time_s)


def test_a_step_costs_the_slower_side_plus_the_transfer_not_the_sum():
    prob = _problem(split=1)
    gen, prox, train = 0, 1, 2
    a = [_pick(prob, gen, 0, 1), _pick(prob, prox, 1, 1), _pick(prob, train, 1, 1)]
    res = simulate(prob, a, ReallocCache(prob), record=True)
    c = [prob.cands[i][a[i]] for i in range(3)]
    realloc_s = res.realloc[(0, gen)][0]
    key = {k: i for i, k in enumerate(prob.key_names)}
    send = {k: prob.key_send_s[key[k]][0] for k in ("seqs", "logprobs", "rewards")}
    # the weights reach GPU 0, the rollout of the previous step reaches GPU 1 (all of
    # it, at once); then GPU 1 scores it (proximal) and trains while GPU 0 generates the
    # next rollout
    sends = send["seqs"] + send["logprobs"] + send["rewards"]
    train_side = c[prox].time_s + c[train].time_s
    assert res.iter_time_s == pytest.approx(realloc_s + sends + max(train_side, c[gen].time_s))
    assert res.iter_time_s < realloc_s + sends + train_side + c[gen].time_s
    ahead = [e for e in res.events if e.name == "actor.generate (next step)"]
    trains = [e for e in res.events if e.name == "actor.train"]
    assert len(ahead) == len(trains) == 2
    assert all(g.start_s < t.end_s and t.start_s < g.end_s for g, t in zip(ahead, trains))
    # the copy it generates with is made at the step's start and kept to its end
    assert res.peak_bytes[0] == pytest.approx(c[gen].weights_bytes + c[gen].activation_bytes)


def test_the_split_keeps_generation_and_training_apart():
    assert async_splits(CPU2) == [1]
    assert async_splits(ClusterSpec(n_nodes=2, gpus_per_node=8,
                                    device=resolve_device("h100-80g"))) == [1, 2, 4, 8]
    prob = _problem(split=1)
    assert {(c.first_gpu, c.n_gpus) for c in prob.cands[0]} == {(0, 1)}
    assert all({(c.first_gpu, c.n_gpus) for c in cs} == {(1, 1)} for cs in prob.cands[1:])


def test_search_finds_a_disjoint_asynchronous_plan_and_one_gpu_has_none():
    graph = build_graph("grpo", SHAPE, {"actor"}, max_staleness=1, asynchronous=True)
    plan = search("t", graph, models("actor"), CPU2, settings=SearchSettings(time_limit_s=10))
    gen = plan.allocation("actor.generate")
    assert plan.asynchronous and list(gen.mesh.gpus) == [0]
    # the all-GPU heuristics cannot express it: said so, not "does not fit in memory"
    why = {h.name: h.not_applicable for h in plan.heuristics}
    assert why["openrlhf"] is None and "generates ahead" in why["megatron"]
    assert "megatron        does not apply: " in table(plan)
    assert all(0 not in a.mesh.gpus for a in plan.allocations if a.mfc != "actor.generate")
    one = ClusterSpec(n_nodes=1, gpus_per_node=1, device=resolve_device("cpu"))
    with pytest.raises(PlanError, match="separate GPUs"):
        search("t", graph, models("actor"), one)


def test_plan_shows_both_modes_with_the_speedup():
    from realign.run.planning import compare_modes
    sync = search("t", build_graph("grpo", SHAPE, {"actor"}, max_staleness=1),
                  models("actor"), CPU2, settings=SearchSettings(time_limit_s=10))
    asyn = search("t", build_graph("grpo", SHAPE, {"actor"}, max_staleness=1,
                                   asynchronous=True),
                  models("actor"), CPU2, settings=SearchSettings(time_limit_s=10))
    chosen = compare_modes(sync, asyn)
    faster = min((sync, asyn), key=lambda p: p.iteration_time_s)
    assert chosen.asynchronous == faster.asynchronous
    assert [m.mode for m in chosen.modes] == ["synchronous", "asynchronous"]
    assert [m.chosen for m in chosen.modes] == [not faster.asynchronous, faster.asynchronous]
    assert async_speedup(chosen) == pytest.approx(sync.iteration_time_s / asyn.iteration_time_s)
    text = table(chosen)
    assert "synchronous vs asynchronous" in text and PROXIMAL_MFC in text
    assert f"{async_speedup(chosen):.2f}x" in text
    assert modes_lines(sync) == []
    # a mode that does not fit is listed as such, and the other is chosen
    only = compare_modes(None, asyn)
    assert only.asynchronous and only.modes[0].iteration_time_s is None
    assert "does not fit" in table(only)


def test_one_sequence_mini_batches_keep_the_synchronous_training_off_data_parallel():
    """tiny-reason-fine-async-cpu's case: 8 rows trained in 8 mini-batches of one row
    cannot be split over two data-parallel ranks, so the synchronous plan trains on one
    data-parallel rank (on one device, or tensor- or pipeline-parallel where the rates
    make that pay); the asynchronous plan gives a device the next step's generation."""
    settings = SearchSettings(time_limit_s=10)

    def train_dp(minibatches, asynchronous=False):
        shape = BatchShape(prompts_per_step=2, samples_per_prompt=4, prompt_len=8,
                           gen_len=64, ppo_minibatches=minibatches)
        plan = search("t", build_graph("grpo", shape, {"actor"}, max_staleness=1,
                                       asynchronous=asynchronous),
                      models("actor"), CPU2, settings=settings)
        return plan.allocation("actor.train").layout.dp, plan

    dp, sync = train_dp(8)
    assert dp == 1 and sync.allocation("actor.generate").layout.dp == 2
    _, asyn = train_dp(8, asynchronous=True)
    assert asyn.asynchronous and asyn.iteration_time_s < sync.iteration_time_s
    # mini-batches of two rows do split over both ranks
    assert train_dp(4)[0] == 2


@pytest.mark.parametrize("every", [1, 3])
def test_an_evaluation_is_never_the_rollout_whatever_its_interval(every):
    """Whether a call evaluates is its purpose, not its interval: at eval.interval 1 the
    held-out generations run every step, and still neither run ahead of training nor
    stand for the rollout (an asynchronous graph with them plans)."""
    from planner.graph.algorithms import EvalShape
    from planner.search.problem import build_problem

    ev = EvalShape(n_prompts=4, samples=2, every=every)
    asyn = build_graph("grpo", SHAPE, {"actor"}, max_staleness=1, asynchronous=True,
                       evaluation=ev)
    evals = [m for m in asyn.mfcs if m.is_eval]
    assert [m.name for m in evals] == ["actor.eval_greedy", "actor.eval_sample"]
    assert all(m.every == every and not asyn.is_ahead(m) for m in evals)
    assert [m.name for m in asyn.mfcs if asyn.is_ahead(m)] == ["actor.generate"]
    assert not any(m.is_eval for m in asyn.mfcs if m.name in ("actor.generate", "actor.train"))
    prob = build_problem(asyn, models("actor"), CostModel(CPU2), n_iters=2, split=1)
    # the evaluations may run on either side of the split, like any evaluation
    i = [m.name for m in asyn.mfcs].index("actor.eval_greedy")
    assert {c.first_gpu for c in prob.cands[i]} == {0, 1}
