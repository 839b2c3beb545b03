"""Packing rows into bins of tokens, and the planner's price of a packed call, by hand
and against a simulation of the runtime's own packing."""
from __future__ import annotations

import random

import numpy as np
import pytest

from planner.cost.cost_model import CostModel, micro_batch_tokens
from planner.errors import PlanError
from planner.graph.dataflow import MFC
from planner.graph.lengths import GenLengths
from planner.graph.packing import (
    PACK_BLOCK,
    budget_for_bins,
    first_fit_decreasing,
    packed_shape,
    round_block,
    row_moments,
)
from planner.graph.padding import row_length_pmf
from planner.specs.cluster import ClusterSpec, resolve_device
from planner.specs.layout import Layout
from planner.specs.mesh import DeviceMesh
from planner.specs.model_spec import model_presets

pytestmark = pytest.mark.pure

CPU = ClusterSpec(n_nodes=1, gpus_per_node=1, device=resolve_device("cpu"))
TINY = model_presets()["tiny-llama"]
#: tiny-reason's shape: responses of 103 tokens on average, 13 % at the cap of 240
TAIL = GenLengths(max_len=240, mean=103.0)


def call(kind="train", n=64, prompt_len=16, gen_len=240, lengths=TAIL, packed=True):
    return MFC(name=f"actor.{kind}", role="actor", kind=kind, n_seqs=n, prompt_len=prompt_len,
               gen_len=gen_len, input_keys=("seqs",), output_keys=("out",), lengths=lengths,
               packed=packed)


def test_first_fit_decreasing_by_hand():
    assert first_fit_decreasing([3, 5, 2, 4], 7) == [[1, 2], [3, 0]]
    assert first_fit_decreasing([4, 4, 4], 12) == [[0, 1, 2]]
    assert first_fit_decreasing([4, 4, 4], 4) == [[0], [1], [2]]
    with pytest.raises(ValueError, match="exceeds"):
        first_fit_decreasing([9], 8)


def test_first_fit_decreasing_keeps_every_row_once_within_the_budget():
    rnd = random.Random(0)
    for _ in range(200):
        lens = [rnd.randint(1, 50) for _ in range(rnd.randint(1, 40))]
        budget = rnd.randint(50, 200)
        bins = first_fit_decreasing(lens, budget)
        assert sorted(i for b in bins for i in b) == list(range(len(lens)))
        assert all(sum(lens[i] for i in b) <= budget for b in bins)
        # no two bins could have been one (first fit leaves no such pair)
        loads = sorted(sum(lens[i] for i in b) for b in bins)
        assert len(loads) < 2 or loads[0] + loads[1] > budget


def test_budget_for_bins():
    assert round_block(17) == 32 and round_block(16) == 16 and round_block(0) == PACK_BLOCK
    assert budget_for_bins([5, 5, 5, 1], 2, block=4) == 12
    assert budget_for_bins([10] * 8, 4) == 32         # 20 each, rounded to a block
    assert budget_for_bins([3, 200], 8) == 208        # at least the longest row
    rnd = random.Random(1)
    for _ in range(50):
        lens = [rnd.randint(1, 120) for _ in range(32)]
        b = budget_for_bins(lens, 4)
        assert len(first_fit_decreasing(lens, b)) <= 4
        assert b - PACK_BLOCK < max(sum(lens) / 4, max(lens)) or \
            len(first_fit_decreasing(lens, b - PACK_BLOCK)) > 4


def test_row_moments_by_hand():
    # prompts at the cap 8, responses 1 or 3 as likely: rows of 9 or 11
    m = call(prompt_len=8, gen_len=3, lengths=GenLengths(max_len=3, histogram=((1, 1), (3, 1))))
    assert row_moments(m) == pytest.approx((10.0, 1.0, 101.0))
    assert row_length_pmf(m).sum() == pytest.approx(1.0)


def _simulated_bin(m: MFC, rows: int, n_mb: int, trials: int = 400) -> float:
    """The runtime's training bin (the fullest of n_mb micro-batches of ``rows`` rows,
    block-rounded), averaged over sampled steps."""
    rng = np.random.default_rng(0)
    pmf = row_length_pmf(m)
    widths = []
    for _ in range(trials):
        lens = rng.choice(len(pmf), size=(n_mb, rows), p=pmf)
        widths.append(round_block(int(lens.sum(axis=1).max())))
    return float(np.mean(widths))


@pytest.mark.parametrize("rows,n_mb", [(8, 1), (8, 4), (32, 2), (2, 8)])
def test_packed_training_bin_matches_the_runtime_within_5_percent(rows, n_mb):
    m = call(n=rows * n_mb)
    tokens, _ = packed_shape(m, rows, n_mb, 1)
    assert tokens == pytest.approx(_simulated_bin(m, rows, n_mb), rel=0.05)


def test_a_packed_call_is_priced_at_its_tokens_not_its_longest_row():
    padded, packed = call(packed=False), call()
    tok_pad, ctx_pad = micro_batch_tokens(padded, 16, 4, 1)
    tok_pack, ctx_pack = micro_batch_tokens(packed, 16, 4, 1)
    mean = row_moments(packed)[0]
    assert tok_pad > 16 * 240                     # the longest of 64 rows is near the cap
    assert 16 * mean < tok_pack < 16 * mean * 1.3
    assert ctx_pack < ctx_pad
    cost = CostModel(CPU)
    one = DeviceMesh(first_gpu=0, n_gpus=1)
    for kind in ("train", "inference"):
        t_pad = cost.mfc_cost(call(kind, packed=False), TINY, "lm", one, Layout(), 4).time_s
        t_pack = cost.mfc_cost(call(kind), TINY, "lm", one, Layout(), 4).time_s
        assert t_pack < 0.7 * t_pad


def test_without_distributions_packing_saves_only_rounding():
    m = call(lengths=None)
    tokens, ctx = packed_shape(m, 4, 2, 1)
    assert tokens == round_block(4 * 256) and ctx == pytest.approx(257 / 2)


def test_a_generate_call_is_not_packed():
    with pytest.raises(PlanError, match="not packed"):
        call("generate")
