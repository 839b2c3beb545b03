"""Token budgets of packed training calls (pure): the bins of whole row groups by hand
and on random lengths, the smallest budget a preference pair needs, and a training
call priced at its budget: its memory below the caps' and its bins those of
budget_shape."""
from __future__ import annotations

import random

import pytest

from planner.cost.cost_model import CostModel
from planner.graph.dataflow import MFC
from planner.graph.lengths import GenLengths
from planner.graph.packing import budget_options, budget_shape, group_bins, round_block
from planner.plan import MFCAllocation
from planner.search.problem import _batching_options
from planner.specs.cluster import ClusterSpec, resolve_device
from planner.specs.layout import Layout
from planner.specs.mesh import DeviceMesh
from planner.specs.model_spec import model_presets

pytestmark = pytest.mark.pure

CPU = ClusterSpec(n_nodes=1, gpus_per_node=1, device=resolve_device("cpu"))
TINY = model_presets()["tiny-llama"]
ONE = DeviceMesh(first_gpu=0, n_gpus=1)
TAIL = GenLengths(max_len=240, mean=103.0)


def train(n=64, group=1, minibatches=1, packed=True, **kw):
    return MFC(name="actor.train", role="actor", kind="train", n_seqs=n, prompt_len=16,
               gen_len=240, input_keys=("seqs",), output_keys=("out",), lengths=TAIL,
               packed=packed, group_size=group, n_minibatches=minibatches, **kw)


def test_group_bins_by_hand():
    assert group_bins([3, 5, 2, 4], 1, 7) == [[1, 2], [0, 3]]
    assert group_bins([3, 5, 2, 4], 2, 14) == [[0, 1, 2, 3]]
    assert group_bins([3, 5, 2, 4], 2, 8) == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="exceeds"):
        group_bins([3, 5, 2, 4], 2, 7)          # the pair (3, 5) needs 8
    with pytest.raises(ValueError, match="groups of 2"):
        group_bins([3, 5, 2], 2, 16)


def test_group_bins_keep_groups_whole_within_the_budget():
    rnd = random.Random(1)
    for _ in range(200):
        g = rnd.choice([1, 2])
        lens = [rnd.randint(1, 40) for _ in range(g * rnd.randint(1, 20))]
        budget = rnd.randint(80, 300)
        bins = group_bins(lens, g, budget)
        assert sorted(i for b in bins for i in b) == list(range(len(lens)))
        for b in bins:
            assert b == sorted(b) and sum(lens[i] for i in b) <= budget
            assert all(i // g * g in b and i // g * g + g - 1 in b for i in b)


def test_a_pair_sets_the_smallest_budget():
    single, pairs = train(), train(group=2)
    assert budget_options(single, 32, 64)[0] == round_block(256)
    assert budget_options(pairs, 32, 64)[0] == round_block(512)
    # rows of one length: whole pairs a bin
    fixed = pairs.model_copy(update={"lengths": None})
    assert budget_shape(fixed, 32, 3 * 256)[0] == 16        # 2 rows a bin, not 3


def test_a_train_call_is_priced_at_its_budget():
    cost = CostModel(CPU)
    m = train(n=64, minibatches=2)
    rows = 32                       # one optimizer step's rows on the one rank
    opts = _batching_options(m, rows, 64)
    assert opts and all(b is not None for _, b in opts)
    assert [b for _, b in opts] == budget_options(m, rows, 64)
    assert _batching_options(train(packed=False), rows, 64)[0] == (1, None)
    small, large = opts[0][1], opts[-1][1]
    assert small < large

    def priced(budget):
        bins = budget_shape(m, rows, budget)[0]
        return bins, cost.mfc_cost(m, TINY, "lm", ONE, Layout(), bins, token_budget=budget)
    (bins_s, c_s), (bins_l, c_l) = priced(small), priced(large)
    assert bins_s > bins_l == 1
    caps = cost.mfc_cost(m, TINY, "lm", ONE, Layout(), bins_s)    # rows / bins at the caps
    assert c_s.activation_bytes < c_l.activation_bytes
    assert c_s.activation_bytes < caps.activation_bytes
    assert c_s.terms_s and c_s.time_s > 0


def test_the_plan_accepts_a_budget_on_a_packed_train_call_only():
    from planner.plan import budget_problems

    a = MFCAllocation.model_fields["token_budget"]
    assert a.default is None

    class Alloc:
        token_budget = 512
    assert budget_problems(Alloc(), train(group=2), "x") == []
    Alloc.token_budget = 496
    assert "a group of 2 rows" in budget_problems(Alloc(), train(group=2), "x")[0]
    Alloc.token_budget = 512
    assert "packed scoring and training" in budget_problems(Alloc(), train(packed=False), "x")[0]
