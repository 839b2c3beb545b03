"""A bench's comparison of the response lengths a plan assumed with those its runs
generated (pure)."""
from __future__ import annotations

import pytest

from planner.graph.algorithms import BatchShape, build_graph
from planner.graph.lengths import GenLengths
from realign.bench.lengths_check import compare, lines, measured, planned

pytestmark = pytest.mark.pure

SHAPE = BatchShape(prompts_per_step=2, samples_per_prompt=4, prompt_len=8, gen_len=10)


def test_planned_lengths_come_from_the_rollout_generation():
    capped = planned(build_graph("grpo", SHAPE, {"actor"}))
    assert capped == {"cap": 10, "mean": 10.0, "at_cap": 1.0}      # no distribution
    hist = GenLengths(max_len=10, histogram=((2, 3.0), (10, 1.0)))
    got = planned(build_graph("grpo", SHAPE, {"actor"}, lengths=hist))
    assert got == pytest.approx({"cap": 10, "mean": (2 * 3 + 10) / 4, "at_cap": 0.25})
    sft = BatchShape(prompts_per_step=4, samples_per_prompt=1, prompt_len=8, gen_len=10)
    assert planned(build_graph("sft", sft, {"actor"})) is None      # nothing generated


def test_measured_lengths_pool_every_step_of_every_run():
    runs = [[{"response_len_hist": [[2, 3], [10, 1]]}, {"loss": 1.0}],
            [{"response_len_hist": [[4, 2], [12, 2]]}]]
    assert measured(runs, cap=10) == pytest.approx(
        {"responses": 8, "mean": (6 + 10 + 8 + 24) / 8, "at_cap": 3 / 8})
    assert measured([[{"response_len": 3.0}]], cap=10) is None        # an older run


def test_the_comparison_and_its_line():
    graph = build_graph("grpo", SHAPE, {"actor"},
                        lengths=GenLengths(max_len=10, mean=5.0))
    c = compare(graph, [[{"response_len_hist": [[10, 4]]}]])
    assert c["cap"] == 10 and c["measured"]["at_cap"] == 1.0
    assert c["planned"]["mean"] == pytest.approx(5.0)
    assert 0 < c["planned"]["at_cap"] < 0.2
    (line,) = lines(c)
    assert "planned mean 5.0 tokens" in line and "measured mean 10.0, 100.0 % at the cap" in line
    assert compare(graph, [[{"loss": 1.0}]]) is None and lines(None) == []
