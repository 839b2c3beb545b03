"""Expert parallelism's rank arithmetic (pure): which experts a rank holds and which
ranks exchange tokens.

Expert parallelism (EP) is carved out of a layout's data-parallel ranks, as megatron
defines it: the ``dp`` ranks of one (tp, pp) position split into ``dp / ep`` EP groups
of ``ep`` consecutive data-parallel ranks; EP rank ``r`` of a group holds experts
``r * E/ep .. (r + 1) * E/ep - 1`` of every sparse layer, and the ranks holding the same
experts (one per EP group) form the expert-data-parallel group that sums those experts'
gradients. Inside each EP rank the experts stay split over TP as the dense MLP is.

Data-parallel rank ``d`` is EP rank ``d % ep`` of EP group ``d // ep``. Example,
tp-dp-pp 2-4-1 with ep 2 (mesh rank = tp_rank + 2 * dp_rank): EP groups
[[0,2],[1,3],[4,6],[5,7]], expert-data-parallel groups [[0,4],[1,5],[2,6],[3,7]].
"""
from __future__ import annotations

from planner.specs.layout import Layout, coords_of_rank, rank_of_coords


def ep_coords(dp_rank: int, ep: int) -> tuple[int, int]:
    """Data-parallel rank -> (EP rank, expert-data-parallel rank). ep 2: dp rank 3 -> (1, 1)."""
    return dp_rank % ep, dp_rank // ep


def local_experts(n_experts: int, ep: int, ep_rank: int) -> range:
    """The experts EP rank ``ep_rank`` holds. 8 experts, ep 2, rank 1 -> range(4, 8)."""
    per = n_experts // ep
    return range(ep_rank * per, (ep_rank + 1) * per)


def expert_owner(expert: int, n_experts: int, ep: int) -> int:
    """The EP rank holding ``expert``. 8 experts, ep 2: expert 5 -> 1."""
    return expert // (n_experts // ep)


def ep_rank_groups(layout: Layout, ep: int) -> list[list[int]]:
    """EP groups in mesh ranks (ranks of one group exchange tokens).
    tp-dp-pp 2-4-1, ep 2 -> [[0,2],[1,3],[4,6],[5,7]]."""
    return _groups(layout, lambda t, d, p: (t, p, d // ep))


def expert_dp_groups(layout: Layout, ep: int) -> list[list[int]]:
    """Expert-data-parallel groups in mesh ranks (ranks holding the same experts).
    tp-dp-pp 2-4-1, ep 2 -> [[0,4],[1,5],[2,6],[3,7]]."""
    return _groups(layout, lambda t, d, p: (t, p, d % ep))


def tp_ep_groups(layout: Layout, ep: int) -> list[list[int]]:
    """TP x EP groups in mesh ranks (megatron's ``tp_ep``).
    tp-dp-pp 2-4-1, ep 2 -> [[0,1,2,3],[4,5,6,7]]."""
    return _groups(layout, lambda t, d, p: (p, d // ep))


def _groups(layout: Layout, key) -> list[list[int]]:
    groups: dict = {}
    for rank in range(layout.world):
        t, d, p = coords_of_rank(rank, layout)
        groups.setdefault(key(t, d, p), []).append(rank)
    assert all(rank_of_coords(*coords_of_rank(r, layout), layout) == r
               for g in groups.values() for r in g)
    return sorted(groups.values())


def holds_tensor(name: str, n_experts: int, ep: int, ep_rank: int) -> bool:
    """Whether EP rank ``ep_rank`` holds logical tensor ``name`` (everything but the
    other ranks' experts). 8 experts, ep 2, rank 0:
    ``decoder.layers.1.mlp.experts.local_experts.5.linear_fc1.weight`` -> False."""
    marker = ".mlp.experts.local_experts."
    if ep == 1 or marker not in name:
        return True
    expert = int(name.split(marker, 1)[1].split(".", 1)[0])
    return expert_owner(expert, n_experts, ep) == ep_rank
