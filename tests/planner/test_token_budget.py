"""The token budget of a packed scoring call: its expected bins by hand and against the
runtime's own first-fit decreasing, its memory, and the search choosing it within
memory where the caps would not fit."""
from __future__ import annotations

import math
import random

import numpy as np
import pytest

from planner.cost.cost_config import CostModelConfig
from planner.cost.cost_model import CostModel
from planner.graph.algorithms import BatchShape, build_graph
from planner.graph.dataflow import MFC
from planner.graph.lengths import GenLengths
from planner.graph.packing import (
    PACK_BLOCK,
    budget_options,
    budget_shape,
    first_fit_decreasing,
    packed_graph,
    round_block,
)
from planner.graph.padding import row_length_pmf
from planner.plan import ExecutionPlan, MFCAllocation, plan_problems
from planner.report import table
from planner.search.problem import RoleModel, _batching_options, build_problem, head_of
from planner.search.search import search
from planner.specs.cluster import ClusterSpec, resolve_device
from planner.specs.layout import Layout
from planner.specs.mesh import DeviceMesh
from planner.specs.model_spec import model_presets

pytestmark = pytest.mark.pure

TINY = model_presets()["tiny-llama"]
ONE = DeviceMesh(first_gpu=0, n_gpus=1)
#: long caps, short rows on average: the caps overprice a scoring call's bins
SHAPE = BatchShape(prompts_per_step=64, samples_per_prompt=4, prompt_len=32, gen_len=480,
                   gen_len_mean=60.0, ppo_minibatches=4)
ROLES = ("actor", "ref")


def scoring(n=32, prompt_len=4, gen_len=4, lengths=None, packed=True):
    return MFC(name="ref.inference", role="ref", kind="inference", n_seqs=n,
               prompt_len=prompt_len, gen_len=gen_len, input_keys=("seqs",),
               output_keys=("out",), lengths=lengths, packed=packed)


def cpu(mem_bytes: float | None = None) -> ClusterSpec:
    dev = resolve_device("cpu")
    if mem_bytes is not None:
        dev = dev.model_copy(update={"mem_bytes": mem_bytes})
    return ClusterSpec(n_nodes=1, gpus_per_node=1, device=dev)


def test_budget_shape_by_hand():
    m = scoring()                                   # rows always 8 tokens
    assert budget_shape(m, 32, 256) == (1, 256.0, 4.5)
    assert budget_shape(m, 32, 512) == (1, 256.0, 4.5)  # whole rows: no more than they are
    assert budget_shape(m, 32, 60) == (5, 64.0, 4.5)    # 7 rows a bin, 56 block-rounded
    assert budget_shape(scoring(prompt_len=8, gen_len=8), 3, 16)[0] == 3   # one per row
    tail = scoring(n=32, prompt_len=4, gen_len=60, lengths=GenLengths(max_len=60, mean=4.0))
    total = 32 * (4 + 4.0)                          # rows of 8 tokens on average
    assert budget_shape(tail, 32, 512)[:2] == (1, pytest.approx(total + PACK_BLOCK / 2))
    assert budget_shape(tail, 32, 64)[:2] == (math.ceil(total / (64 - 8 / 2)), 64.0)


def test_budget_options_by_hand():
    m = scoring(n=8, prompt_len=50, gen_len=50)
    assert budget_options(m, 8, 8) == [112, 128, 208, 256, 400, 512, 800]
    assert budget_options(m, 8, 4) == [208, 256, 400, 512, 800]
    assert budget_options(m, 8, 1) == [800]          # the whole share always stays
    assert all(b % PACK_BLOCK == 0 and b >= round_block(m.seq_len)
               for b in budget_options(scoring(n=512, gen_len=300,
                                               lengths=GenLengths(max_len=300, mean=40.0)),
                                       512, 64))


@pytest.mark.parametrize("rows,budget", [(64, 512), (64, 1024), (256, 1024), (256, 4096)])
def test_expected_bins_match_the_runtime_within_a_fifth(rows, budget):
    m = scoring(n=rows, prompt_len=16, gen_len=480, lengths=GenLengths(max_len=480, mean=60.0))
    p = row_length_pmf(m)
    rng = np.random.default_rng(0)
    counts = [len(first_fit_decreasing(
        [int(x) for x in rng.choice(len(p), size=rows, p=p)], budget)) for _ in range(20)]
    bins, _, _ = budget_shape(m, rows, budget)
    assert bins == pytest.approx(sum(counts) / len(counts), rel=0.2)


def test_first_fit_decreasing_by_budget_keeps_rows_within_it():
    rnd = random.Random(1)
    for _ in range(100):
        lens = [rnd.randint(1, 100) for _ in range(rnd.randint(1, 60))]
        budget = round_block(rnd.randint(100, 600))
        bins = first_fit_decreasing(lens, budget)
        assert sorted(i for b in bins for i in b) == list(range(len(lens)))
        assert all(sum(lens[i] for i in b) <= budget for b in bins)
        assert len(bins) >= math.ceil(sum(lens) / budget)


def test_memory_is_priced_at_the_budget_not_the_caps():
    m = scoring(n=256, prompt_len=32, gen_len=480, lengths=GenLengths(max_len=480, mean=60.0))
    cost = CostModel(cpu())

    def act(budget=None, mb=1):
        return cost.mfc_cost(m, TINY, "lm", ONE, Layout(), mb,
                             token_budget=budget).activation_bytes
    assert act(1024) < act(4096) < act(16384)
    assert act(4096) == pytest.approx(act(mb=64) * 4096 / (4 * 512))   # 4 rows at the cap
    with pytest.raises(ValueError, match="packed scoring and training calls only"):
        cost.mfc_cost(scoring(packed=False), TINY, "lm", ONE, Layout(), 1, token_budget=64)


def test_only_packed_scoring_without_fixed_micro_batches_searches_budgets():
    packed = scoring(n=32)
    assert all(b is not None for _, b in _batching_options(packed, 32, 64))
    assert _batching_options(packed.model_copy(update={"micro_batches": 4}), 32, 64) == [(4, None)]
    assert all(b is None for _, b in _batching_options(scoring(packed=False), 32, 64))


def _problem(mem_bytes=None):
    models = {r: RoleModel(r, TINY, head_of(r)) for r in ROLES}
    graph = packed_graph(build_graph("grpo", SHAPE, set(ROLES)))
    cfg = CostModelConfig(max_micro_batches=8)
    return graph, models, cfg, build_problem(graph, models, CostModel(cpu(mem_bytes), cfg))


def test_the_search_picks_a_budget_within_memory_where_the_caps_do_not_fit():
    graph, models, cfg, prob = _problem()
    ref = graph.mfc("ref.inference")
    i = [m.name for m in graph.mfcs].index("ref.inference")
    cands = prob.cands[i]
    assert cands and all(c.token_budget is not None for c in cands)
    # the caps: the fewest tokens per micro-batch, at the most micro-batches the search takes
    caps = CostModel(cpu(), cfg).mfc_cost(ref, TINY, "lm", ONE, Layout(), 8).activation_bytes
    smallest = min(c.activation_bytes for c in cands)
    assert smallest < caps / 2
    resident = max(c.resident_bytes for cs in prob.cands for c in cs)
    others = max(min(c.activation_bytes for c in cs)
                 for m, cs in zip(graph.mfcs, prob.cands) if m.name != ref.name)
    limit = resident + max(others, smallest, (smallest + caps) / 2 - resident)
    assert limit < caps
    plan = search("t", graph, models, cpu(limit / cfg.mem_usable_fraction), cfg)
    a = plan.allocation("ref.inference")
    assert a.token_budget is not None and a.token_budget in budget_options(ref, 256, 8)
    assert a.micro_batches == budget_shape(ref, 256, a.token_budget)[0]
    assert a.mem_bytes <= plan.mem_limit_bytes
    assert all(x.token_budget is None for x in plan.allocations if x.kind == "generate")
    assert f"budget {a.token_budget} tok" in table(plan)
    assert not plan_problems(plan)
    again = ExecutionPlan.from_json(plan.to_json())
    assert again.allocation("ref.inference").token_budget == a.token_budget


def test_a_budget_on_another_call_is_a_plan_problem():
    graph, models, cfg, _ = _problem()
    plan = search("t", graph, models, cpu(), cfg)
    bad = [x.model_copy(update={"token_budget": 512}) if x.kind == "generate" else x
           for x in plan.allocations]
    problems = plan_problems(plan.model_copy(update={"allocations": tuple(bad)}))
    assert any("token_budget is for packed scoring and training calls" in p for p in problems)
    small = [x.model_copy(update={"token_budget": 100}) if x.kind == "inference" else x
             for x in plan.allocations]
    problems = plan_problems(plan.model_copy(update={"allocations": tuple(small)}))
    assert any("must be a multiple of 16" in p for p in problems)
    assert MFCAllocation.model_fields["token_budget"].default is None
