"""Expert parallelism's rank arithmetic (realign.runtime.ep_groups), pure: the groups
megatron's definition gives and which experts each rank holds (the refusals are the
planner's rule: tests/planner/test_moe_ep)."""
from __future__ import annotations

import pytest

from planner.specs.layout import Layout
from realign.runtime.ep_groups import (
    ep_coords,
    ep_rank_groups,
    expert_dp_groups,
    expert_owner,
    holds_tensor,
    local_experts,
    tp_ep_groups,
)

pytestmark = pytest.mark.pure


def test_groups_of_the_docstring_example():
    layout = Layout(tp=2, dp=4)
    assert ep_rank_groups(layout, 2) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert expert_dp_groups(layout, 2) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert tp_ep_groups(layout, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]


@pytest.mark.parametrize("tp,pp,dp,ep", [(1, 1, 2, 2), (2, 2, 4, 2), (1, 2, 8, 4), (2, 1, 4, 4)])
def test_groups_partition_the_mesh_and_cross_once(tp, pp, dp, ep):
    layout = Layout(tp=tp, pp=pp, dp=dp)
    eps, edps = ep_rank_groups(layout, ep), expert_dp_groups(layout, ep)
    for groups, size in ((eps, ep), (edps, dp // ep)):
        assert sorted(r for g in groups for r in g) == list(range(layout.world))
        assert all(len(g) == size for g in groups)
    # an EP group and an expert-DP group of one (tp, pp) position share exactly one rank
    assert all(len(set(a) & set(b)) <= 1 for a in eps for b in edps)


def test_experts_split_evenly_over_ep_ranks():
    assert [list(local_experts(8, 2, r)) for r in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [expert_owner(e, 8, 4) for e in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert ep_coords(3, 2) == (1, 1) and ep_coords(2, 2) == (0, 1)
    name = "decoder.layers.1.mlp.experts.local_experts.5.linear_fc1.weight"
    assert not holds_tensor(name, 8, 2, 0) and holds_tensor(name, 8, 2, 1)
    assert holds_tensor("decoder.layers.1.mlp.router.weight", 8, 2, 0)
    assert holds_tensor(name, 8, 1, 0)
