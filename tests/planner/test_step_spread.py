"""The spread of a call's time over steps, and the asynchronous step's slower side per
step (Clark's expected maximum), by hand."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest

from planner.cost.cost_model import CostModel
from planner.cost.step_spread import call_time_sd, expected_max
from planner.graph.algorithms import BatchShape, build_graph
from planner.graph.lengths import GenLengths, longest_moments
from planner.search.problem import RoleModel, build_problem, head_of
from planner.search.simulator import ReallocCache, simulate
from planner.specs.cluster import ClusterSpec, resolve_device
from planner.specs.layout import Layout
from planner.specs.mesh import DeviceMesh
from planner.specs.model_spec import model_presets

pytestmark = pytest.mark.pure

SHAPE = BatchShape(prompts_per_step=2, samples_per_prompt=4, prompt_len=8, gen_len=64,
                   ppo_minibatches=1)
CPU2 = ClusterSpec(n_nodes=1, gpus_per_node=2, device=resolve_device("cpu"))
TINY = model_presets()["tiny-llama"]
ONE = DeviceMesh(first_gpu=0, n_gpus=1)
L1 = Layout(tp=1, pp=1, dp=1)


def test_expected_max_by_hand():
    # two equal means of spread 1: the mean + sqrt(2) phi(0) = the mean + 1/sqrt(pi)
    assert expected_max(5.0, 1.0, 5.0, 1.0) == pytest.approx(5.0 + 1 / math.sqrt(math.pi))
    assert expected_max(2.0, 0.0, 3.0, 0.0) == 3.0           # nothing varies: the later
    # far apart: the later mean, all but exactly
    assert expected_max(10.0, 1.0, 0.0, 1.0) == pytest.approx(10.0, abs=1e-12)
    # one side fixed at its mean: m + s phi(0) when both means are equal
    assert expected_max(4.0, 2.0, 4.0, 0.0) == pytest.approx(4.0 + 2 / math.sqrt(2 * math.pi))
    assert expected_max(1.0, 0.5, 1.2, 0.3) > 1.2


def test_the_longest_of_a_batch_by_hand():
    two = GenLengths(max_len=20, histogram=((1, 0.5), (2, 0.5)))
    # the longer of two: 1 with 1/4, 2 with 3/4
    mean, var = longest_moments(two, 20, 2)
    assert mean == pytest.approx(1.75) and var == pytest.approx(3.25 - 1.75 ** 2)
    three = GenLengths(max_len=20, histogram=((3, 1.0),))
    assert longest_moments(three, 20, 8) == pytest.approx((3.0, 0.0))
    assert longest_moments(three, 20, 8, every=8) == pytest.approx((8.0, 0.0))


def graph(lengths=None, asynchronous=True):
    return build_graph("grpo", SHAPE, {"actor"}, lengths=lengths, max_staleness=1,
                       asynchronous=asynchronous)


def sd(g, name, mb=1):
    cost = CostModel(CPU2)
    m = g.mfc(name)
    return call_time_sd(cost, g, m, TINY, "lm", ONE, L1, mb)


def test_only_an_asynchronous_graph_with_varying_lengths_spreads():
    spread = GenLengths(max_len=64, mean=16)
    assert sd(graph(spread, asynchronous=False), "actor.generate") == 0.0
    assert sd(graph(None), "actor.generate") == 0.0
    fixed = GenLengths(max_len=64, histogram=((3, 1.0),))
    assert sd(graph(fixed), "actor.generate") == 0.0 and sd(graph(fixed), "actor.train") == 0.0
    assert sd(graph(spread), "actor.generate") > 0 and sd(graph(spread), "actor.train") > 0


def test_a_call_on_the_rollout_spreads_by_the_padded_length():
    # the training runs on the batch padded to its longest row (prompt + response):
    # its spread is the call priced at that length's mean against one standard
    # deviation shorter
    spread = GenLengths(max_len=64, mean=16)
    g = graph(spread)
    m = g.mfc("actor.train")
    cost = CostModel(CPU2)
    mean, var = longest_moments(spread, 64, m.n_seqs)
    rows = m.prompt_len + round(mean)

    def at(n):
        return m.model_copy(update={"prompt_len": n, "gen_len": 0, "lengths": None})
    by_hand = (cost.mfc_cost(at(rows), TINY, "lm", ONE, L1, 1).time_s
               - cost.mfc_cost(at(rows - round(math.sqrt(var))), TINY, "lm", ONE, L1, 1).time_s)
    assert sd(g, "actor.train") == pytest.approx(by_hand) and by_hand > 0


def test_the_asynchronous_step_ends_at_the_expected_slower_side():
    g = graph(GenLengths(max_len=64, mean=16))
    prob = build_problem(g, {"actor": RoleModel("actor", TINY, head_of("actor"))},
                         CostModel(CPU2), n_iters=1, split=1)
    a = [0, 0, 0]
    c = [prob.cands[i][0] for i in range(3)]
    assert c[0].time_sd_s > 0 and c[2].time_sd_s > 0
    # the same step without spreads: its two sides' ends
    flat = replace(prob, cands=[[replace(x, time_sd_s=0.0) for x in cs] for cs in prob.cands])
    res0 = simulate(flat, a, ReallocCache(flat), record=True)
    gen_end = max(e.end_s for e in res0.events if e.name == "actor.generate (next step)")
    train_end = max(e.end_s for e in res0.events if e.name == "actor.train")
    res = simulate(prob, a, ReallocCache(prob))
    # the training side's calls all follow one batch's lengths: their spreads add
    want = expected_max(gen_end, c[0].time_sd_s, train_end, c[1].time_sd_s + c[2].time_sd_s)
    assert res.iter_time_s == pytest.approx(want)
    assert res.iter_time_s > res0.iter_time_s == pytest.approx(max(gen_end, train_end))


def test_plans_say_what_the_slower_side_per_step_adds():
    from planner.report import modes_lines
    from planner.search.search import SearchSettings, search
    from realign.run.planning import compare_modes
    actor = {"actor": RoleModel("actor", TINY, head_of("actor"))}
    quick = SearchSettings(time_limit_s=10)
    spread = GenLengths(max_len=64, mean=16)
    asyn = search("t", graph(spread), actor, CPU2, settings=quick)
    sync = search("t", graph(spread, asynchronous=False), actor, CPU2, settings=quick)
    assert sync.slower_side_s == 0.0 and 0 < asyn.slower_side_s < asyn.iteration_time_s
    fixed = search("t", graph(None), actor, CPU2, settings=quick)
    assert fixed.slower_side_s == 0.0
    both = compare_modes(sync, asyn)
    row = next(ln for ln in modes_lines(both) if "slower side per step" in ln)
    assert f"+{asyn.slower_side_s:.3f} s" in row and row.split()[4] == "-"
    assert not any("slower side" in ln for ln in modes_lines(compare_modes(sync, fixed)))
