"""The lengths a batch is padded to, which scoring, training and a wave's prefill are
priced at, by hand."""
from __future__ import annotations

import pytest

from planner.cost.cost_model import CostModel
from planner.errors import PlanError
from planner.graph.algorithms import BatchShape, EvalShape, build_graph
from planner.graph.dataflow import MFC
from planner.graph.lengths import GenLengths
from planner.graph.padding import longest_prompt, padded_len, padded_moments
from planner.specs.cluster import ClusterSpec, resolve_device
from planner.specs.layout import Layout
from planner.specs.mesh import DeviceMesh
from planner.specs.model_spec import model_presets

pytestmark = pytest.mark.pure

CPU = ClusterSpec(n_nodes=1, gpus_per_node=1, device=resolve_device("cpu"))
TINY = model_presets()["tiny-llama"]
ONE, L1 = DeviceMesh(first_gpu=0, n_gpus=1), Layout()
#: prompts of 4 or 6 tokens, as likely (cap 8)
FOUR_OR_SIX = GenLengths(max_len=8, histogram=((4, 1.0), (6, 1.0)))


def call(kind="train", n=2, prompt_len=8, gen_len=2, lengths=None, prompts=None):
    return MFC(name=f"actor.{kind}", role="actor", kind=kind, n_seqs=n, prompt_len=prompt_len,
               gen_len=gen_len, input_keys=("seqs",), output_keys=("out",), lengths=lengths,
               prompt_lengths=prompts)


def test_without_distributions_the_caps():
    assert padded_len(call()) == 10.0
    assert padded_moments(call(kind="generate", lengths=GenLengths(max_len=2, mean=1.5))) \
        == (10.0, 0.0)
    assert longest_prompt(call(kind="generate"), 4) == 8.0


def test_the_longest_row_by_hand():
    # responses of 3 always (cap 20), prompts at the cap 8: every row is 11 long
    always3 = GenLengths(max_len=20, histogram=((3, 1.0),))
    assert padded_moments(call(gen_len=20, lengths=always3)) == pytest.approx((11.0, 0.0))
    # prompts of 4 or 6, responses of 2 always, two rows: both 6 long with chance 1/4,
    # else the longest is 8: mean 7.5, variance 0.25 x 36 + 0.75 x 64 - 7.5^2 = 0.75
    mean, var = padded_moments(call(prompts=FOUR_OR_SIX))
    assert mean == pytest.approx(7.5) and var == pytest.approx(0.75)
    # the sum of two independent lengths: prompts 4 or 6, responses 1 or 3 -> rows of
    # 5, 7 (twice as likely) or 9; one row: the mean 7
    one_or_three = GenLengths(max_len=3, histogram=((1, 1.0), (3, 1.0)))
    assert padded_len(call(n=1, gen_len=3, lengths=one_or_three, prompts=FOUR_OR_SIX)) \
        == pytest.approx(7.0)


def test_the_longest_prompt_of_a_wave():
    gen = call(kind="generate", prompts=FOUR_OR_SIX)
    assert longest_prompt(gen, 1) == pytest.approx(5.0)
    assert longest_prompt(gen, 2) == pytest.approx(0.25 * 4 + 0.75 * 6)


def test_a_response_past_its_cap_is_cut_at_it():
    # a distribution recorded with a higher cap than the call's: lengths past it count
    # at the cap (one row: prompt 8 + E[min(L, 2)] with L = 1 or 3 -> 8 + 1.5)
    one_or_three = GenLengths(max_len=3, histogram=((1, 1.0), (3, 1.0)))
    assert padded_len(call(n=1, gen_len=2, lengths=one_or_three)) == pytest.approx(9.5)


def test_calls_are_priced_at_the_padded_length_and_their_memory_at_the_caps():
    cost = CostModel(CPU)
    five = GenLengths(max_len=8, histogram=((5, 1.0),))
    for kind in ("train", "inference"):
        padded = cost.mfc_cost(call(kind, n=8, gen_len=4, prompts=five), TINY, "lm", ONE, L1, 1)
        short = cost.mfc_cost(call(kind, n=8, prompt_len=5, gen_len=4), TINY, "lm", ONE, L1, 1)
        capped = cost.mfc_cost(call(kind, n=8, gen_len=4), TINY, "lm", ONE, L1, 1)
        assert padded.time_s == pytest.approx(short.time_s)
        assert padded.time_s < capped.time_s
        assert padded.activation_bytes == capped.activation_bytes > short.activation_bytes
    # a wave prefills its prompts padded to its longest: 5 tokens, its cache at the cap
    gen = cost.mfc_cost(call("generate", n=8, gen_len=4, prompts=five), TINY, "lm", ONE, L1, 1)
    short = cost.mfc_cost(call("generate", n=8, prompt_len=5, gen_len=4), TINY, "lm", ONE, L1, 1)
    capped = cost.mfc_cost(call("generate", n=8, gen_len=4), TINY, "lm", ONE, L1, 1)
    assert gen.terms_s["prefill_gemm"] == pytest.approx(short.terms_s["prefill_gemm"])
    assert gen.terms_s["prefill_gemm"] < capped.terms_s["prefill_gemm"]
    assert gen.activation_bytes == capped.activation_bytes


SHAPE = BatchShape(prompts_per_step=2, samples_per_prompt=2, prompt_len=8, gen_len=4)


def test_the_graph_carries_the_prompt_lengths_to_the_rollout_and_its_readers():
    g = build_graph("ppo", SHAPE, {"actor", "critic", "ref", "reward"}, prompt_lengths=FOUR_OR_SIX,
                    evaluation=EvalShape(n_prompts=4, samples=1, every=2))
    for m in g.mfcs:
        held_out = m.input_keys[0].startswith("eval")
        assert m.prompt_lengths == (None if held_out else FOUR_OR_SIX), m.name
    asyn = build_graph("grpo", SHAPE, {"actor"}, prompt_lengths=FOUR_OR_SIX, max_staleness=1,
                       asynchronous=True)
    assert all(m.prompt_lengths == FOUR_OR_SIX for m in asyn.mfcs)


def test_prompt_lengths_must_have_the_prompt_cap():
    with pytest.raises(PlanError) as e:
        build_graph("grpo", SHAPE, {"actor"}, prompt_lengths=GenLengths(max_len=16, mean=4))
    assert e.value.field == "algorithm.prompt_len" and "16" in e.value.message


def test_a_plan_priced_with_other_lengths_runs_the_same_calls():
    from planner.search.manual import executed, graph_diff
    priced = build_graph("grpo", SHAPE, {"actor"}, prompt_lengths=FOUR_OR_SIX,
                         lengths=GenLengths(max_len=4, mean=2))
    plain = build_graph("grpo", SHAPE, {"actor"})
    assert priced != plain and executed(priced) == executed(plain)
    other = build_graph("grpo", SHAPE.model_copy(update={"gen_len": 5}), {"actor"})
    assert "gen_len is 4 in the plan, 5 here" in graph_diff(executed(plain), executed(other))
