"""A ReMax streaming plan (rollout.mode: streaming): the greedy baseline of each prompt
is one more sample of its group in the stream, so the schedule's group is
samples_per_prompt + 1 and a batch the prompts a step trains; the plan's check accepts
it and refuses a group without the baseline."""
from __future__ import annotations

import json

import pytest

from planner.errors import PlanError
from planner.graph.algorithms import BatchShape, build_graph
from planner.graph.lengths import GenLengths
from planner.plan import ExecutionPlan
from planner.plan_streaming import greedy_rows, streaming_problems
from planner.search.search import SearchSettings
from planner.search.stream_search import search_ahead
from tests.planner.test_stream_plan import CPU2, _models

pytestmark = pytest.mark.pure


def test_a_remax_stream_decodes_one_greedy_sample_per_group():
    shape = BatchShape(prompts_per_step=8, samples_per_prompt=4, prompt_len=8, gen_len=256,
                       ppo_minibatches=1)
    graph = build_graph("remax", shape, {"actor"}, max_staleness=2, asynchronous=True,
                        lengths=GenLengths(max_len=256, mean=40.0))
    assert greedy_rows(graph) == 8
    _, stream = search_ahead("remax", graph, _models(), CPU2, group_size=4,
                             on_update="continue",
                             settings=SearchSettings(method="exact", seed=0, time_limit_s=60))
    st = stream.streaming
    assert st is not None and (st.group_size, st.batch_groups) == (5, 8)
    assert st.samples_per_s == pytest.approx(32 / st.step_s)    # the trained samples
    # both rollout calls on the generation side, the check passes
    gen = {a.mfc: a.mesh.first_gpu for a in stream.allocations}
    assert gen["actor.generate"] == gen["actor.greedy_generate"] == 0
    assert streaming_problems(stream) == []
    bad = json.loads(stream.model_dump_json())
    bad["streaming"]["group_size"] = 4          # no slot for the baseline
    with pytest.raises(PlanError, match="with the greedy baselines"):
        ExecutionPlan.model_validate(bad)
