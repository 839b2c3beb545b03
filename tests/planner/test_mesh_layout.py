"""Device meshes, layouts and the rank arithmetic that places (tp, dp, pp) on GPUs."""
from __future__ import annotations

import itertools

import pytest

from planner.errors import PlanError
from planner.graph.dataflow import MFC
from planner.specs.cluster import ClusterSpec, resolve_device
from planner.specs.layout import (
    Allocation,
    Layout,
    check_allocation,
    coords_of_rank,
    dp_groups,
    enumerate_layouts,
    group_spans_nodes,
    layout_problems,
    pp_groups,
    rank_of_coords,
    shard_placement,
    stage_layers,
    tp_groups,
)
from planner.specs.mesh import DeviceMesh, enumerate_meshes
from planner.specs.model_spec import ModelSpec, model_presets

pytestmark = pytest.mark.pure

DEV = resolve_device("a100-80g")


def cluster(n_nodes: int, gpn: int) -> ClusterSpec:
    return ClusterSpec(n_nodes=n_nodes, gpus_per_node=gpn, device=DEV)


def mesh(first: int, n: int) -> DeviceMesh:
    return DeviceMesh(first_gpu=first, n_gpus=n)


def is_valid(m: DeviceMesh, c: ClusterSpec) -> bool:
    try:
        m.validate_on(c)
    except PlanError:
        return False
    return True


# ---- meshes -------------------------------------------------------------------

@pytest.mark.parametrize("n_nodes,gpn,count", [
    (2, 4, 15),            # the docstring: 8 + 4 + 2 + 1
    (1, 8, 15),            # 8 + 4 + 2 + the node
    (16, 8, 16 * 14 + 136),  # 14 sub-node meshes per node + 16*17/2 node runs
    (1, 1, 1),
    (3, 2, 6 + 6),         # 6 single GPUs; runs of 1, 2, 3 nodes: 3 + 2 + 1
])
def test_enumerate_meshes_counts(n_nodes, gpn, count):
    ms = enumerate_meshes(cluster(n_nodes, gpn))
    assert len(ms) == count
    assert len(set(ms)) == count
    assert [m.n_gpus for m in ms] == sorted(m.n_gpus for m in ms)  # smallest first


@pytest.mark.parametrize("n_nodes,gpn", [(2, 4), (1, 8), (3, 2), (2, 6), (2, 3), (4, 1)])
def test_enumerate_meshes_is_exactly_the_valid_meshes(n_nodes, gpn):
    """Brute force: every (first, size) that validate_on accepts, and nothing else."""
    c = cluster(n_nodes, gpn)
    brute = {mesh(f, n) for n in range(1, c.n_gpus + 1) for f in range(c.n_gpus - n + 1)
             if is_valid(mesh(f, n), c)}
    assert set(enumerate_meshes(c)) == brute


def test_no_valid_mesh_straddles_a_node_boundary_unless_whole_nodes():
    for n_nodes, gpn in [(2, 4), (2, 6), (3, 3), (2, 8)]:
        c = cluster(n_nodes, gpn)
        for m in enumerate_meshes(c):
            nodes = {c.node_of(g) for g in m.gpus}
            if len(nodes) > 1:
                assert m.n_gpus % gpn == 0 and m.first_gpu % gpn == 0


@pytest.mark.parametrize("first,n,msg", [
    (1, 2, "aligned to it"),                   # misaligned
    (2, 4, "whole nodes"),                    # a node's worth, not at a boundary
    (0, 3, "power-of-two size"),              # 3 inside a node of 4
    (0, 6, "whole nodes"),                    # more than a node, not whole nodes
    (6, 4, "exceed the cluster's 8 GPUs"),    # beyond the cluster
    (0, 16, "exceed the cluster's 8 GPUs"),
])
def test_invalid_meshes_say_why(first, n, msg):
    with pytest.raises(PlanError, match=msg) as e:
        mesh(first, n).validate_on(cluster(2, 4), field="plan.allocations.x.mesh")
    assert e.value.field == "plan.allocations.x.mesh"


def test_a_power_of_two_that_does_not_divide_the_node_is_invalid():
    """On 6-GPU nodes, 4 GPUs at 4 would straddle nodes 0 and 1."""
    c = cluster(2, 6)
    with pytest.raises(PlanError):
        mesh(4, 4).validate_on(c)
    with pytest.raises(PlanError):
        mesh(0, 4).validate_on(c)
    mesh(4, 2).validate_on(c)
    mesh(6, 6).validate_on(c)


def test_mesh_names():
    assert mesh(0, 1).name(4) == "n0:g0"
    assert mesh(6, 2).name(4) == "n1:g2-3"
    assert mesh(4, 4).name(4) == "n1"
    assert mesh(0, 8).name(4) == "n0-1"
    assert mesh(8, 16).name(8) == "n1-2"
    assert mesh(3, 1).name(1) == "n3:g0"
    assert mesh(2, 2).name(1) == "n2-3"


def test_overlaps():
    assert mesh(0, 4).overlaps(mesh(2, 2)) and mesh(2, 2).overlaps(mesh(0, 4))
    assert mesh(0, 4).overlaps(mesh(0, 4))
    assert not mesh(0, 2).overlaps(mesh(2, 2)) and not mesh(2, 2).overlaps(mesh(0, 2))


# ---- rank arithmetic ----------------------------------------------------------

def test_docstring_example_2_2_2():
    lay = Layout(tp=2, pp=2, dp=2)
    assert tp_groups(lay) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dp_groups(lay) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert pp_groups(lay) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert coords_of_rank(5, lay) == (1, 0, 1)
    assert rank_of_coords(1, 0, 1, lay) == 5


@pytest.mark.parametrize("tp,dp,pp", [(1, 1, 1), (2, 2, 2), (4, 2, 1), (1, 3, 2),
                                      (2, 1, 4), (8, 2, 2), (3, 5, 2)])
def test_coords_and_rank_are_inverse(tp, dp, pp):
    lay = Layout(tp=tp, pp=pp, dp=dp)
    coords = [coords_of_rank(r, lay) for r in range(lay.world)]
    assert sorted(coords) == sorted(itertools.product(range(tp), range(dp), range(pp)))
    assert [rank_of_coords(*c, lay) for c in coords] == list(range(lay.world))
    # tp is fastest, then dp, then pp
    assert coords_of_rank(1, lay)[0] == (1 if tp > 1 else 0)
    # every group family partitions the ranks, and a group varies one coordinate only
    for groups, axis, size in ((tp_groups(lay), 0, tp), (dp_groups(lay), 1, dp),
                               (pp_groups(lay), 2, pp)):
        assert sorted(r for g in groups for r in g) == list(range(lay.world))
        for g in groups:
            assert len(g) == size
            cs = [coords_of_rank(r, lay) for r in g]
            assert [c[axis] for c in cs] == list(range(size))
            others = {tuple(x for k, x in enumerate(c) if k != axis) for c in cs}
            assert len(others) == 1


def test_stage_layers_split_equally():
    assert [list(stage_layers(8, 4, j)) for j in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert list(stage_layers(8, 1, 0)) == list(range(8))


def test_group_spans_nodes():
    m = mesh(0, 8)  # two nodes of 4
    lay = Layout(tp=2, pp=1, dp=4)
    assert not group_spans_nodes(tp_groups(lay)[0], m, 4)
    assert group_spans_nodes(dp_groups(lay)[0], m, 4)           # ranks 0,2,4,6
    assert not group_spans_nodes([0, 2], mesh(4, 4), 4)         # node 1 only


# ---- layout validity ----------------------------------------------------------

TOY = ModelSpec(name="toy", n_layers=6, hidden=96, n_heads=12, n_kv_heads=4,
                ffn_hidden=72, vocab_size=200)   # padded vocab 256


def mfc(kind: str = "inference", n_seqs: int = 24, minibatches: int = 1) -> MFC:
    return MFC(name=f"actor.{kind}", role="actor", kind=kind, n_seqs=n_seqs, prompt_len=8,
               gen_len=8, input_keys=("d",), output_keys=("o",), n_minibatches=minibatches)


def problems(tp, pp, dp, n_gpus=None, mb=1, m=None, c=None, model=TOY):
    n = n_gpus if n_gpus is not None else tp * pp * dp
    return layout_problems(Layout(tp=tp, pp=pp, dp=dp), mesh(0, n), model, m or mfc(), mb,
                           c or cluster(4, 8))


def test_a_valid_layout_has_no_problems():
    assert problems(4, 2, 1) == []
    assert problems(2, 3, 4) == []
    assert problems(1, 1, 8, m=mfc("train", 48, 2)) == []


@pytest.mark.parametrize("tp,pp,dp,n,snippet", [
    (2, 1, 1, 4, "tp*pp*dp = 2 but the mesh has 4 GPUs"),
    (8, 1, 1, 8, "must divide the 12 heads and 4 KV heads"),    # 12 % 8
    (3, 1, 1, 3, "must divide the 12 heads and 4 KV heads"),    # 4 kv % 3
    (3, 1, 1, 3, "must divide the 8 GPUs of a node"),
    (16, 1, 1, 16, "must divide the 8 GPUs of a node"),         # TP across nodes
    (1, 4, 1, 4, "pp=4 must divide the 6 layers"),
    (1, 1, 16, 16, "dp=16 must divide the 24 sequences per step"),
])
def test_layout_problems_name_the_constraint(tp, pp, dp, n, snippet):
    assert any(snippet in p for p in problems(tp, pp, dp, n_gpus=n))


def test_ffn_and_vocab_divisibility():
    m = TOY.model_copy(update={"ffn_hidden": 70, "n_heads": 4, "n_kv_heads": 4,
                               "hidden": 96})
    assert any("ffn_hidden 70" in p for p in problems(4, 1, 1, model=m))
    assert problems(2, 1, 1, model=m) == []
    # a padded vocabulary is a multiple of 128, so only TP > 128 can fail to divide it
    wide = ModelSpec(name="wide", n_layers=2, hidden=256, n_heads=256, n_kv_heads=256,
                     ffn_hidden=256, vocab_size=100)
    assert any("padded vocabulary 128" in p
               for p in problems(256, 1, 1, model=wide, c=cluster(1, 256)))


def test_batch_and_micro_batch_divisibility():
    train = mfc("train", n_seqs=48, minibatches=4)      # 12 sequences per step
    assert problems(1, 1, 4, m=train) == []
    assert any("dp=8 must divide the 12 sequences per step" in p
               for p in problems(1, 1, 8, m=train))
    assert problems(1, 1, 4, m=train, mb=3) == []       # 3 per replica, 3 micro-batches
    assert any("micro_batches=2 must divide the 3 sequences per replica" in p
               for p in problems(1, 1, 4, m=train, mb=2))
    # inference has no mini-batches: all 48 sequences per call
    assert problems(1, 1, 16, m=mfc("inference", 48)) == []


def test_check_allocation_raises_with_the_field():
    c = cluster(2, 4)
    good = Allocation(mesh=mesh(0, 4), layout=Layout(tp=2, dp=2))
    check_allocation(good, TOY, mfc(), c, "plan.actor")
    with pytest.raises(PlanError, match="must divide the 6 layers") as e:
        check_allocation(Allocation(mesh=mesh(0, 4), layout=Layout(pp=4)), TOY, mfc(), c,
                         "plan.actor")
    assert e.value.field == "plan.actor"
    with pytest.raises(PlanError) as e:
        check_allocation(Allocation(mesh=mesh(1, 2), layout=Layout(dp=2)), TOY, mfc(), c,
                         "plan.actor")
    assert e.value.field == "plan.actor.mesh"


def test_shard_placement_is_mesh_tp_and_pp_only():
    """The one reallocation rule's key: candidates (the simulator's) and plan
    allocations (the run's) compute it alike; micro-batches do not enter it."""
    from planner.search.problem import Candidate

    def cand(first, n, tp, pp, mb):
        return Candidate(first, n, tp, pp, n // (tp * pp), mb, 1.0, 0.0, 0.0, 0.0)

    a = cand(0, 4, 2, 1, 1)
    assert a.shards == cand(0, 4, 2, 1, 4).shards == shard_placement(0, 4, 2, 1)
    assert a.shards != cand(0, 4, 4, 1, 1).shards
    assert a.shards != cand(4, 4, 2, 1, 1).shards
    assert a.shards != cand(0, 4, 2, 2, 1).shards


@pytest.mark.parametrize("model,first,n,n_nodes,gpn", [
    ("tiny-llama", 0, 8, 1, 8), ("tiny-llama-8l", 0, 8, 2, 4), ("llama2-7b", 0, 16, 2, 8),
    ("qwen2.5-0.5b", 4, 4, 1, 8), ("llama3-8b", 0, 16, 4, 4)])
def test_enumerate_layouts_is_the_valid_subset(model, first, n, n_nodes, gpn):
    spec = model_presets()[model]
    c = cluster(n_nodes, gpn)
    m = mfc("train", n_seqs=64, minibatches=2)
    got = enumerate_layouts(mesh(first, n), spec, m, c)
    brute = [Layout(tp=tp, pp=pp, dp=dp) for tp in range(1, n + 1) for pp in range(1, n + 1)
             for dp in range(1, n + 1)
             if tp * pp * dp == n and not layout_problems(
                 Layout(tp=tp, pp=pp, dp=dp), mesh(first, n), spec, m, 1, c)]
    assert sorted(got, key=str) == sorted(brute, key=str)
    assert len(set(got)) == len(got)
    assert Layout(tp=1, pp=1, dp=n) in got         # pure data parallelism always fits here
    assert all(lay.tp <= gpn for lay in got)


def test_enumerate_layouts_examples():
    spec = model_presets()["tiny-llama"]   # 4 heads, 2 KV heads, 4 layers
    got = set(enumerate_layouts(mesh(0, 8), spec, mfc("inference", 8), cluster(1, 8)))
    assert got == {Layout(tp=tp, pp=pp, dp=8 // (tp * pp))
                   for tp in (1, 2) for pp in (1, 2, 4) if 8 % (tp * pp) == 0}
