"""A reallocation costs the same when both placements move along the cluster by whole
nodes (the rule the C++ core's ReallocCache shares prices by: it keys a pair of meshes
moved down to node 0). realloc_time reads GPU numbers only through their node and their
distance from the meshes' first GPUs, so the seconds and bytes are equal exactly, not
approximately."""
from __future__ import annotations

import random

import pytest

from planner.cost.realloc_cost import Links, ReallocModel, realloc_time
from planner.specs.cluster import ClusterSpec, resolve_device
from planner.specs.layout import enumerate_layouts
from planner.specs.lora import LoraSpec
from planner.specs.mesh import enumerate_meshes
from planner.specs.model_spec import model_presets

pytestmark = pytest.mark.pure


def placements(cluster: ClusterSpec, model: str) -> list[tuple[int, ...]]:
    """(first_gpu, n_gpus, tp, pp, dp, ep) of every layout of ``model``'s training on
    every mesh of ``cluster``."""
    from planner.graph.algorithms import BatchShape, build_graph

    graph = build_graph("ppo", BatchShape(prompts_per_step=64, prompt_len=16, gen_len=16,
                                          ppo_minibatches=1), {"actor", "critic", "ref",
                                                               "reward"})
    train = next(m for m in graph.mfcs if m.kind == "train" and m.role == "actor")
    spec = model_presets()[model]
    return [(mesh.first_gpu, mesh.n_gpus, lay.tp, lay.pp, lay.dp, lay.ep)
            for mesh in enumerate_meshes(cluster)
            for lay in enumerate_layouts(mesh, spec, train, cluster, max_ep=8)]


@pytest.mark.parametrize("model,head,lora", [("llama2-7b", "lm", None),
                                             ("llama2-7b", "value", None),
                                             ("tiny-llama", "lm", LoraSpec(rank=4)),
                                             ("qwen3-30b-a3b", "lm", None)])
def test_pairs_moved_by_whole_nodes_cost_the_same(model, head, lora):
    gpn, nodes = 4, 4
    cluster = ClusterSpec(n_nodes=nodes, gpus_per_node=gpn, device=resolve_device("h100-80g"))
    m = ReallocModel.of(model_presets()[model], head, 2, lora)
    links = Links(gpus_per_node=gpn, intra_bytes_per_s=3e11, inter_bytes_per_s=2.5e10,
                  intra_latency_s=1e-5, inter_latency_s=5e-5, fixed_s=1e-3,
                  copy_bytes_per_s=2e12)
    places = placements(cluster, model)
    rng = random.Random(7)
    moved = 0
    for _ in range(300):
        src, dst = rng.choice(places), rng.choice(places)
        hi = max(src[0] + src[1], dst[0] + dst[1])
        low = min(src[0], dst[0]) // gpn * gpn
        for shift in range(-low, nodes * gpn - hi + 1, gpn):
            if shift == 0:
                continue
            a = (src[0] + shift,) + src[1:]
            b = (dst[0] + shift,) + dst[1:]
            assert realloc_time(m, a, b, links) == realloc_time(m, src, dst, links), (
                src, dst, shift)
            moved += 1
    assert moved > 100


@pytest.mark.parametrize("model,head", [("llama2-7b", "lm"), ("qwen3-30b-a3b", "value")])
def test_pairs_on_separate_nodes_cost_the_same_however_far_apart(model, head):
    """The C++ cache's second rule: when no node holds GPUs of both meshes, every byte
    crosses nodes and the price does not depend on the nodes between them, so the upper
    mesh may move down to the node after the lower one's last."""
    gpn, nodes = 4, 8
    cluster = ClusterSpec(n_nodes=nodes, gpus_per_node=gpn, device=resolve_device("h100-80g"))
    m = ReallocModel.of(model_presets()[model], head, 2, None)
    links = Links(gpus_per_node=gpn, intra_bytes_per_s=3e11, inter_bytes_per_s=2.5e10,
                  intra_latency_s=1e-5, inter_latency_s=5e-5, fixed_s=1e-3,
                  copy_bytes_per_s=2e12)

    def node_span(p: tuple[int, ...]) -> tuple[int, int]:
        return p[0] // gpn, (p[0] + p[1] - 1) // gpn

    places = placements(cluster, model)
    rng = random.Random(11)
    closed = 0
    for _ in range(400):
        src, dst = rng.choice(places), rng.choice(places)
        (s_lo, s_hi), (d_lo, d_hi) = node_span(src), node_span(dst)
        if s_hi < d_lo:
            near = (src, (dst[0] - (d_lo - s_hi - 1) * gpn,) + dst[1:])
        elif d_hi < s_lo:
            near = ((src[0] - (s_lo - d_hi - 1) * gpn,) + src[1:], dst)
        else:
            continue
        if near == (src, dst):
            continue
        assert realloc_time(m, *near, links) == realloc_time(m, src, dst, links), (src, dst)
        assert realloc_time(m, src, dst, links)[1] > 0
        closed += 1
    assert closed > 50
