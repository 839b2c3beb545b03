"""A DAPO stream's training side (planner.search.stream_search.price_sides): DAPO's
graph scores the rollout's over-generated rows (16 prompts' groups for the 8 a step
trains at a share of 0.5), but a stream drops the constant groups at the buffer, so its
training side receives, scores and trains the 32 rows of the kept batch. Its step is
priced as the same allocations on the graph of no drops (dropped_group_frac 0), checked
against the hand-written plan's pricing (planner.search.manual), not the one-step plan's
timeline."""
from __future__ import annotations

import math

import pytest

from planner.graph.algorithms import BatchShape, build_graph
from planner.graph.dataflow import DataflowGraph
from planner.graph.lengths import GenLengths
from planner.plan import ExecutionPlan
from planner.search.manual import manual_plan
from planner.search.problem import RoleModel, head_of
from planner.search.search import SearchSettings
from planner.search.stream_search import (
    price_sides,
    priced_on,
    search_ahead,
    stream_train_graph,
    train_side_s,
)
from planner.specs.layout import Allocation
from planner.specs.model_spec import model_presets
from tests.planner.test_stream_plan import CPU2

pytestmark = pytest.mark.pure

ROLES = ("actor", "ref")
LENGTHS = GenLengths(max_len=256, mean=40.0)


def _shape(frac: float) -> BatchShape:
    return BatchShape(prompts_per_step=8, samples_per_prompt=4, prompt_len=8, gen_len=256,
                      ppo_minibatches=1, dropped_group_frac=frac)


def _graph(frac: float) -> DataflowGraph:
    return build_graph("dapo", _shape(frac), set(ROLES), max_staleness=2, asynchronous=True,
                       lengths=LENGTHS)


def _models() -> dict[str, RoleModel]:
    tiny = model_presets()["tiny-llama"]
    return {r: RoleModel(r, tiny, head_of(r)) for r in ROLES}


@pytest.fixture(scope="module")
def stream() -> ExecutionPlan:
    _, plan = search_ahead("dapo", _graph(0.5), _models(), CPU2, group_size=4,
                           on_update="continue", constant_share=0.5,
                           settings=SearchSettings(method="exact", seed=0, time_limit_s=60))
    assert plan.streaming is not None
    return plan


def _undropped(plan: ExecutionPlan) -> ExecutionPlan:
    """``plan``'s allocations on the graph of no drops, priced as a hand-written plan."""
    allocs = {a.mfc: Allocation(mesh=a.mesh, layout=a.layout, micro_batches=a.micro_batches)
              for a in plan.allocations}
    return manual_plan("undropped", _graph(0.0), _models(), CPU2, allocs, plan.cost_config)


def test_the_training_side_graph_holds_the_trained_batch():
    g = _graph(0.5)
    assert [(m.name, m.n_seqs) for m in g.mfcs] == [
        ("actor.generate", 64), ("ref.inference", 64), ("actor.prox_inference", 64),
        ("actor.train", 32)]
    side = stream_train_graph(g)
    assert {m.name: m.n_seqs for m in side.mfcs} == {m.name: m.n_seqs
                                                     for m in _graph(0.0).mfcs}
    assert all(m.n_seqs == 32 for m in side.mfcs)
    undropped = _graph(0.0)        # no over-generation: the graph itself
    assert stream_train_graph(undropped) is undropped


def test_a_plan_priced_on_its_own_graph_repeats_its_timeline(stream):
    again = priced_on(stream, stream.graph)
    assert again.timeline == stream.timeline
    assert [a.time_s for a in again.allocations] == [a.time_s for a in stream.allocations]


def test_a_dapo_stream_scores_the_kept_batch_on_its_training_side(stream):
    side = priced_on(stream, stream_train_graph(stream.graph))
    ref = _undropped(stream)
    for call in ("ref.inference", "actor.prox_inference", "actor.train"):
        assert side.allocation(call).time_s == pytest.approx(ref.allocation(call).time_s)
    # the one-step plan prices the scoring calls at the 64 rows it over-generates
    for call in ("ref.inference", "actor.prox_inference"):
        assert side.allocation(call).time_s < stream.allocation(call).time_s
    assert train_side_s(side) == pytest.approx(train_side_s(ref))


def test_the_streams_training_step_is_the_kept_batchs(stream):
    st = stream.streaming
    assert st is not None and st.batch_groups * st.group_size == 32
    sides = price_sides(stream, st.gen_gpus)
    assert sides.train_iters == st.train_iters
    assert sides.train_iters == math.ceil(train_side_s(_undropped(stream)) / sides.iter_s)
    # the over-generated rows would price the step well beyond it (352 iterations, 229)
    assert math.ceil(train_side_s(stream) / sides.iter_s) > 1.2 * sides.train_iters
