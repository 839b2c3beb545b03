"""planner.cost.realloc_cost's time model against hand computation: a GPU is busy receiving
on its links plus writing its destination shard (received and local slices) at the copy
rate, a sender is busy sending; the busiest GPU, one message latency when anything
crosses a wire, and the fixed cost per reallocation.

A model in round bytes: 2 layers of 1000 TP-split + 10 replicated bytes, embedding 400,
final norm 4, untied LM head 400. One full copy is 400 + 2 x 1010 + 4 + 400 = 2824 bytes.
Links: 1000 B/s within a node, 100 B/s across, latency 0.5 s / 5 s, copies 1e4 B/s,
fixed 10 s.
"""
from __future__ import annotations

import pytest

from planner.cost.realloc_cost import HEAD_LM_UNTIED, Links, ReallocModel, realloc_time

pytestmark = pytest.mark.pure

M = ReallocModel(n_layers=2, layer_sharded_bytes=1000, layer_replicated_bytes=10,
                 embedding_bytes=400, final_norm_bytes=4, head_kind=HEAD_LM_UNTIED,
                 head_bytes=400)
FULL = 2824


def links(gpn: int) -> Links:
    return Links(gpus_per_node=gpn, intra_bytes_per_s=1e3, inter_bytes_per_s=1e2,
                 intra_latency_s=0.5, inter_latency_s=5.0, fixed_s=10.0,
                 copy_bytes_per_s=1e4)


def approx(x):
    return pytest.approx(x, rel=1e-12, abs=0)


def test_tp2_to_dp2_on_the_same_gpus():
    # each GPU holds half of every TP-split tensor (200 + 1000 + 200 bytes) and all the
    # replicated ones (20 + 4); it receives the other half (1400 bytes) from its peer
    # and copies 1424 bytes locally; each also sends 1400
    t, moved = realloc_time(M, (0, 2, 2, 1, 1), (0, 2, 1, 1, 2), links(gpn=2))
    assert moved == 2 * 1400
    assert t == approx(10 + 1400 / 1e3 + (1400 + 1424) / 1e4 + 0.5)


def test_the_same_move_across_nodes_pays_the_nic():
    t, moved = realloc_time(M, (0, 2, 2, 1, 1), (0, 2, 1, 1, 2), links(gpn=1))
    assert moved == 2800
    assert t == approx(10 + 1400 / 1e2 + (1400 + 1424) / 1e4 + 5.0)


def test_nothing_to_move_pays_fixed_and_local_copies():
    t, moved = realloc_time(M, (0, 2, 2, 1, 1), (0, 2, 2, 1, 1), links(gpn=2))
    assert moved == 0
    assert t == approx(10 + 1424 / 1e4)        # no latency: nothing on the wire


def test_a_whole_copy_to_another_gpu():
    t, moved = realloc_time(M, (0, 1, 1, 1, 1), (1, 1, 1, 1, 1), links(gpn=2))
    assert moved == FULL
    assert t == approx(10 + FULL / 1e3 + FULL / 1e4 + 0.5)


def test_one_sender_for_two_receivers_is_sender_bound():
    # GPU 0 holds the only copy; GPUs 1 and 2 each need all of it: GPU 0 sends 2 x 2824
    t, moved = realloc_time(M, (0, 1, 1, 1, 1), (1, 2, 1, 1, 2), links(gpn=4))
    assert moved == 2 * FULL
    assert 2 * FULL / 1e3 > FULL / 1e3 + FULL / 1e4
    assert t == approx(10 + 2 * FULL / 1e3 + 0.5)
