"""DAPO's sampling rounds in the planner: the expected rounds (against a brute-force
twin), the graph's rollout calls that carry them, and their price."""
from __future__ import annotations

import math
from functools import lru_cache

import pytest

from planner.errors import PlanError
from planner.graph.algorithms import BatchShape, build_graph
from planner.graph.dataflow import MFC
from planner.graph.sampling_rounds import (
    MAX_SAMPLING_ROUNDS,
    binomial_cdf_below,
    expected_rounds,
    full_batch_chance,
    round_size,
    sized_rounds,
)
from planner.specs.layout import Layout
from planner.specs.mesh import DeviceMesh
from tests.planner.test_cost_model import TOY, cost_model, mfc

pytestmark = pytest.mark.pure

SHAPE = BatchShape(prompts_per_step=8, samples_per_prompt=4, prompt_len=16, gen_len=32,
                   ppo_minibatches=2, dropped_group_frac=0.25)


@pytest.mark.parametrize("n,p,k", [(4, 0.5, 2), (10, 0.3, 0), (10, 0.3, 11), (12, 0.9, 7),
                                   (30, 0.55, 16), (7, 1.0, 7), (7, 0.0, 1)])
def test_binomial_cdf_below_sums_the_terms(n, p, k):
    brute = sum(math.comb(n, j) * p ** j * (1 - p) ** (n - j) for j in range(min(k, n + 1)))
    assert binomial_cdf_below(n, p, k) == pytest.approx(brute, rel=1e-12, abs=1e-300)


def rounds_by_enumeration(n: int, wanted: int, f: float, max_rounds: int) -> float:
    """The slow twin: the round loop itself, state by state (kept so far), each round's
    kept groups by their binomial distribution."""
    q = 1 - f
    pmf = [math.comb(n, j) * q ** j * f ** (n - j) for j in range(n + 1)]

    @lru_cache(maxsize=None)
    def rounds_from(kept: int, done: int) -> float:
        if kept >= wanted or done == max_rounds:
            return 0.0
        return 1.0 + sum(pj * rounds_from(min(wanted, kept + j), done + 1)
                         for j, pj in enumerate(pmf))
    return rounds_from(0, 0)


@pytest.mark.parametrize("n,wanted,f,r", [(11, 8, 0.25, 4), (6, 6, 0.5, 8), (3, 2, 0.9, 5),
                                          (30, 16, 0.45, 4), (8, 8, 0.0, 3), (5, 4, 0.7, 1)])
def test_expected_rounds_equal_the_loop_enumerated(n, wanted, f, r):
    assert expected_rounds(n, wanted, f, r) == pytest.approx(
        rounds_by_enumeration(n, wanted, f, r), rel=1e-10)


def test_expected_rounds_grow_with_the_drop_rate_within_the_cap():
    got = [expected_rounds(30, 16, f, 6) for f in (0.0, 0.3, 0.45, 0.6, 0.8, 0.95)]
    assert got[0] == 1.0
    assert all(a < b for a, b in zip(got, got[1:]))
    assert got[-1] <= 6
    assert expected_rounds(30, 16, 0.95, 1) == 1.0
    # the docstring's example: one round short in about a third of the steps
    assert expected_rounds(30, 16, 0.45, 4) == pytest.approx(1.355, abs=5e-4)
    assert full_batch_chance(30, 16, 0.45, 4) == pytest.approx(1.0, abs=1e-12)
    assert full_batch_chance(30, 16, 0.45, 1) == pytest.approx(1 - 0.3552, abs=1e-4)
    with pytest.raises(ValueError):
        expected_rounds(30, 16, 0.45, MAX_SAMPLING_ROUNDS + 1)


def test_the_rollout_and_its_scoring_carry_the_rounds_not_the_train_call():
    g = {m.name: m for m in build_graph("dapo", SHAPE, {"actor", "ref", "reward"},
                                        max_sampling_rounds=4).mfcs}
    # 11 prompts first, 8 kept; later rounds sized to the missing groups, cap 8 x 11
    want = sized_rounds(11, 8, 0.25, 4, 88)[1] / 11
    assert 1.0 < want < 4.0
    for name in ("actor.generate", "reward.inference", "ref.inference"):
        assert g[name].sampling_rounds == pytest.approx(want)
        assert g[name].n_seqs == 44                  # the first round: the plan's shape
    # priced at a recorded drop rate and a cap: more passes at a higher rate
    hot = {m.name: m for m in build_graph("dapo", SHAPE, {"actor"}, max_sampling_rounds=4,
                                          max_round_prompts=30, sampling_drop_frac=0.9).mfcs}
    assert hot["actor.generate"].sampling_rounds == pytest.approx(
        sized_rounds(11, 8, 0.9, 4, 30)[1] / 11)
    assert hot["actor.generate"].sampling_rounds > 3 * want
    assert g["actor.train"].sampling_rounds == 1.0 and g["actor.train"].n_seqs == 32
    # a synchronous rollout scored by the training forward: once, after the rounds
    s = {m.name: m for m in build_graph("dapo", SHAPE, {"actor"}, max_sampling_rounds=4,
                                        score_rollout=True).mfcs}
    assert s["actor.prox_inference"].sampling_rounds == 1.0
    one = build_graph("dapo", SHAPE, {"actor"})
    assert all(m.sampling_rounds == 1.0 for m in one.mfcs)


def test_rounds_refused_where_they_cannot_run():
    with pytest.raises(PlanError, match="samples once") as e:
        build_graph("grpo", SHAPE.model_copy(update={"dropped_group_frac": None}), {"actor"},
                    max_sampling_rounds=2)
    assert e.value.field == "algorithm.params.max_sampling_rounds"
    with pytest.raises(PlanError, match="one step ahead") as e:
        build_graph("dapo", SHAPE, {"actor"}, max_sampling_rounds=2, max_staleness=1,
                    asynchronous=True)
    assert e.value.field == "algorithm.params.max_sampling_rounds"
    with pytest.raises(PlanError, match="once a step"):
        MFC.model_validate({**mfc("train").model_dump(), "sampling_rounds": 2.0})


@pytest.mark.parametrize("kind", ["generate", "inference"])
def test_a_call_of_several_rounds_costs_that_many_passes_and_the_memory_of_one(kind):
    cm = cost_model()
    one = cm.mfc_cost(mfc(kind), TOY, "lm", DeviceMesh(first_gpu=0, n_gpus=2),
                      Layout(tp=2), 2)
    more = cm.mfc_cost(mfc(kind).model_copy(update={"sampling_rounds": 1.7}), TOY, "lm",
                       DeviceMesh(first_gpu=0, n_gpus=2), Layout(tp=2), 2)
    assert more.time_s == pytest.approx(1.7 * one.time_s, rel=1e-12)
    assert more.terms_s == pytest.approx({k: 1.7 * v for k, v in one.terms_s.items()})
    assert (more.weights_bytes, more.resident_bytes, more.activation_bytes) == (
        one.weights_bytes, one.resident_bytes, one.activation_bytes)


@pytest.mark.parametrize("missing,f,cap,quantum,want", [
    (3, 0.5, 120, 4, 12),        # n (1 - f) - 1.645 sqrt(n f (1 - f)) >= 3: n = 11.6
    (13, 0.9, 120, 2, 120),      # needs ~190: the cap
    (0, 0.5, 120, 4, 4),         # one quantum at least
    (5, 1.0, 120, 4, 120),       # every group constant so far: the cap
    (5, 0.0, 120, 3, 6),         # nothing dropped: the missing groups, to the quantum
    (16, 0.97, 50, 8, 48),       # the cap rounded down to the quantum
    (1, 0.5, 4, 4, 4)])          # a cap of one quantum
def test_a_later_round_is_sized_from_the_drop_rate(missing, f, cap, quantum, want):
    n = round_size(missing, f, cap, quantum)
    assert n == want and n <= cap and n % quantum == 0
    if n < cap // quantum * quantum and missing:
        # its kept groups reach the missing ones with the margin's chance or more
        assert binomial_cdf_below(n, 1 - f, missing) <= 0.1


@pytest.mark.parametrize("missing,f,cap,quantum", [(5, 1.0, 3, 8), (1, 0.5, 3, 4),
                                                   (0, 0.0, 7, 8)])
def test_a_cap_below_the_quantum_is_refused(missing, f, cap, quantum):
    # no multiple of the quantum fits the cap: a round would exceed it
    with pytest.raises(ValueError, match="round_size"):
        round_size(missing, f, cap, quantum)


def test_rounds_sized_from_the_rate_grow_with_it_and_fill_more_than_fixed_rounds():
    # more missing groups, a higher rate: more prompts
    assert round_size(8, 0.5, 10_000) < round_size(16, 0.5, 10_000) < round_size(
        16, 0.8, 10_000)
    # the tiny task late in a run (f 0.95): rounds of the first round's 30 prompts fill
    # almost never, rounds sized from the rate (cap 240) nearly always
    assert full_batch_chance(30, 16, 0.95, 4) < 1e-3
    rounds, prompts, full = sized_rounds(30, 16, 0.95, 4, 240)
    assert full > 0.99 and rounds < 3.0 and 300 < prompts < 30 + 3 * 240


def sized_by_enumeration(first: int, wanted: int, f: float, max_rounds: int, cap: int,
                         quantum: int = 1) -> tuple[float, float, float]:
    """The slow twin of sized_rounds: the loop state by state (missing groups)."""
    q = 1 - f

    @lru_cache(maxsize=None)
    def go(missing: int, done: int) -> tuple[float, float, float]:
        if missing == 0:
            return 0.0, 0.0, 1.0
        if done == max_rounds:
            return 0.0, 0.0, 0.0
        n = first if done == 0 else round_size(missing, f, cap, quantum)
        r, p, full = 1.0, float(n), 0.0
        for j in range(n + 1):
            pj = math.comb(n, j) * q ** j * f ** (n - j)
            a, b, c = go(max(0, missing - j), done + 1)
            r, p, full = r + pj * a, p + pj * b, full + pj * c
        return r, p, full
    return go(wanted, 0)


@pytest.mark.parametrize("first,wanted,f,r,cap", [(11, 8, 0.25, 4, 88), (6, 6, 0.5, 5, 20),
                                                  (3, 2, 0.9, 5, 12), (30, 16, 0.45, 4, 240),
                                                  (8, 8, 0.0, 3, 8), (5, 4, 0.7, 1, 40)])
def test_sized_rounds_equal_the_loop_enumerated(first, wanted, f, r, cap):
    assert sized_rounds(first, wanted, f, r, cap) == pytest.approx(
        sized_by_enumeration(first, wanted, f, r, cap), rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("first,wanted,f,r,cap,quantum", [(12, 8, 0.25, 4, 88, 4),
                                                          (6, 6, 0.5, 5, 20, 3),
                                                          (30, 16, 0.45, 4, 240, 6)])
def test_sized_rounds_price_the_runtimes_quantum(first, wanted, f, r, cap, quantum):
    # the planner sizes later rounds in the runtime's multiples (round_quantum)
    priced = sized_rounds(first, wanted, f, r, cap, quantum)
    assert priced == pytest.approx(sized_by_enumeration(first, wanted, f, r, cap, quantum),
                                   rel=1e-9, abs=1e-12)
    assert priced[1] >= sized_rounds(first, wanted, f, r, cap)[1]
