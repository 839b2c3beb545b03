"""Streaming plans (rollout.mode: streaming): the steady state of the stream against
hand-checked cases, the search's split and staleness on a long tail against the
one-step-ahead plan, the plan's JSON round trip and its picture."""
from __future__ import annotations

import json

import pytest

from planner.errors import PlanError
from planner.graph.algorithms import BatchShape, build_graph
from planner.graph.lengths import GenLengths
from planner.graph.stream_steady import sim_scale, steady_stream
from planner.graph.streaming import StreamSettings
from planner.plan import ExecutionPlan
from planner.report import modes_lines
from planner.search.modes import choose_mode
from planner.search.problem import RoleModel, head_of
from planner.search.search import SearchSettings
from planner.search.stream_search import decode_shape, pick_stream, price_sides, search_ahead
from planner.specs.cluster import ClusterSpec, resolve_device
from planner.specs.model_spec import model_presets
from planner.specs.streaming_plan import StreamingPlan
from planner.timeline_svg import render

pytestmark = pytest.mark.pure

CPU2 = ClusterSpec(n_nodes=1, gpus_per_node=2, device=resolve_device("cpu"))
#: 8 prompts x 4 samples, responses of 40 tokens on average with a cap of 256
TAIL = BatchShape(prompts_per_step=8, samples_per_prompt=4, prompt_len=8, gen_len=256,
                  ppo_minibatches=1)


def _settings(train: int, update: int, k: int = 2) -> StreamSettings:
    # 2 groups of 4 a step, 8 slots: a batch of 100-token responses every 100 iterations
    return StreamSettings(group_size=4, batch_groups=2, slots=8, train_iters=train,
                          update_iters=update, max_staleness=k)


@pytest.mark.parametrize("train, update", [(300, 0), (50, 0), (50, 20), (300, 20), (100, 0)])
def test_constant_lengths_step_the_slower_of_generating_a_batch_and_training(train, update):
    # the generator makes a batch in 100 iterations and pauses `update` for each copy;
    # the trainer needs `train`: a step lasts the slower of the two
    est = steady_stream(_settings(train, update), [100] * 4000, steps=10)
    assert est.iters_per_step == max(100 + update, train)
    if train > 100 + update:                      # trainer-bound: it never waits
        assert est.train_idle_share == 0.0
    else:                                         # generator-bound: it waits the difference
        assert est.train_idle_share == pytest.approx(1 - train / (100 + update))
        assert est.gen_idle_share == 0.0 and est.staleness_mean == 1.0


def test_a_coarser_clock_and_a_narrower_pool_give_the_same_constant_steady_state():
    exact = steady_stream(_settings(300, 20), [100] * 4000, steps=10)
    small = steady_stream(_settings(300, 20), [100] * 4000, steps=10, quantum=10, shrink=2)
    assert small.iters_per_step == exact.iters_per_step == 300
    assert small.staleness_mean == exact.staleness_mean


def test_sim_scale_keeps_a_capped_response_within_256_units_and_128_slots():
    s = StreamSettings(group_size=8, batch_groups=256, slots=2048, train_iters=1,
                       update_iters=0, max_staleness=2)
    assert sim_scale(s, 3840) == (15, 16)
    assert sim_scale(_settings(1, 0), 240) == (1, 1)


def _models():
    return {"actor": RoleModel("actor", model_presets()["tiny-llama"], head_of("actor"))}


@pytest.fixture(scope="module")
def ahead():
    graph = build_graph("grpo", TAIL, {"actor"}, max_staleness=2, asynchronous=True,
                        lengths=GenLengths(max_len=256, mean=40.0))
    return search_ahead("tail", graph, _models(), CPU2, group_size=4, on_update="continue",
                        settings=SearchSettings(method="exact", seed=0, time_limit_s=60))


def test_streaming_on_a_long_tail_beats_or_equals_one_step_ahead(ahead):
    asyn, stream = ahead
    st = stream.streaming
    assert asyn.streaming is None and st is not None
    assert stream.iteration_time_s == st.step_s <= asyn.iteration_time_s
    assert (st.gen_gpus, st.train_gpus) == (1, 1)
    assert 1 <= st.max_staleness <= 2 and 0 < st.staleness_mean <= st.max_staleness
    assert st.samples_per_s == pytest.approx(32 / st.step_s)
    # the generator's clock is the rollout call's: its priced seconds over its iterations
    gen = stream.allocation("actor.generate")
    iters, slots = decode_shape(stream.graph.mfc("actor.generate"), gen)
    assert st.slots == slots and st.iter_s == pytest.approx(gen.time_s / iters)
    assert price_sides(stream, 1).train_iters == st.train_iters


def test_the_modes_side_by_side_choose_the_fastest(ahead):
    asyn, stream = ahead
    plan = choose_mode({"asynchronous": asyn, "streaming": stream})
    assert plan.streaming is not None
    assert [(m.mode, m.chosen) for m in plan.modes] == [("asynchronous", False),
                                                        ("streaming", True)]
    assert plan.modes[1].gen_gpus == 1 and plan.modes[0].staleness_mean == 1.0
    text = "\n".join(modes_lines(plan))
    assert "split gen+train GPUs" in text and "streaming (chosen)" in text
    assert "staleness bound" in text
    # an experiment that asks for a mode runs it, and the table says which is faster
    asked = choose_mode({"asynchronous": asyn, "streaming": stream}, run="asynchronous")
    assert asked is not plan and asked.streaming is None
    assert [m.chosen for m in asked.modes] == [True, False]


def test_a_streaming_plan_round_trips_through_json_and_is_checked(ahead):
    _, stream = ahead
    back = ExecutionPlan.from_json(stream.to_json())
    assert back == stream and back.streaming == stream.streaming
    raw = json.loads(stream.to_json())
    raw["streaming"]["gen_gpus"] = 2                  # more GPUs than the cluster has
    with pytest.raises(PlanError, match="gen_gpus 2 \\+ train_gpus 1"):
        ExecutionPlan.from_json(json.dumps(raw))



@pytest.mark.parametrize("edit, says", [
    ({"capacity_groups": 4}, "capacity_groups 4 is less than a batch's batch_groups 8"),
    ({"batch_groups": 16, "capacity_groups": 32},
     "group_size 4 x batch_groups 16 is not the 32 sequences the actor trains"),
    ({"group_size": 8}, "group_size 8 x batch_groups 8 is not the 32 sequences the actor trains")])
def test_a_hand_edited_streaming_section_is_refused(ahead, edit, says):
    _, stream = ahead
    raw = json.loads(stream.to_json())
    assert raw["streaming"]["batch_groups"] == 8 and raw["streaming"]["group_size"] == 4
    raw["streaming"].update(edit)
    with pytest.raises(PlanError, match=says):
        ExecutionPlan.from_json(json.dumps(raw))

def test_a_streaming_plans_picture_shows_both_sides_and_the_updates(ahead):
    _, stream = ahead
    svg = render(stream)
    assert "per step streaming" in svg
    assert svg.count(">actor.train step") >= 3 and "weights v1" in svg
    assert "GPU 0" in svg and "GPU 1" in svg


def test_a_trainer_bound_stream_with_one_batch_of_buffer_drops_nothing():
    # training 21 iterations, a batch made in 8: a buffer of two batches lets a third of
    # the groups wait past the bound of 1; a buffer of one batch, the same step, none
    def est(cap):
        s = StreamSettings(group_size=4, batch_groups=16, slots=64, train_iters=21,
                           update_iters=1, max_staleness=1, capacity_groups=cap)
        return steady_stream(s, [8] * 20000, steps=16)
    one, two = est(16), est(32)
    assert one.iters_per_step == two.iters_per_step == 21
    assert one.dropped_share == 0.0 and two.dropped_share == pytest.approx(1 / 3)



def test_a_narrower_pool_gives_the_same_dropped_share():
    # the dropped groups and the trained ones are counted on the same narrowed batch
    s = StreamSettings(group_size=4, batch_groups=16, slots=64, train_iters=21,
                       update_iters=1, max_staleness=1, capacity_groups=32)
    exact = steady_stream(s, [8] * 20000, steps=16)
    half = steady_stream(s, [8] * 20000, steps=16, shrink=2)
    assert exact.dropped_share == pytest.approx(1 / 3)
    assert half.dropped_share == pytest.approx(exact.dropped_share)

def _stream(step_s, dropped, k, cap):
    return StreamingPlan(gen_gpus=1, train_gpus=1, group_size=4, batch_groups=16, slots=64,
                         train_iters=21, update_iters=1, max_staleness=k,
                         capacity_groups=cap, iter_s=0.01, step_s=step_s,
                         samples_per_s=64 / step_s, staleness_mean=1.0, gen_idle_share=0.0,
                         train_idle_share=0.0, dropped_share=dropped)


def test_pick_stream_keeps_the_fewest_drops_among_the_equally_fast():
    fast_dropping = _stream(1.000, 0.2, 1, 32)
    near_clean = _stream(1.005, 0.0, 2, 48)          # within 1 %: no drops wins
    assert pick_stream([fast_dropping, near_clean]) == near_clean
    slow_clean = _stream(1.050, 0.0, 2, 48)          # 5 % slower: speed wins
    assert pick_stream([fast_dropping, slow_clean]) == fast_dropping
    small = _stream(1.0, 0.0, 1, 16)                 # ties: the smaller bound and buffer
    assert pick_stream([_stream(1.0, 0.0, 2, 16), _stream(1.0, 0.0, 1, 32), small]) == small
