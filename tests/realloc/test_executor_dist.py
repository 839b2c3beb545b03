"""CPU multi-process tier: the executor on 4 real gloo ranks, bit for bit.

One 4-rank world is spawned for the whole module and runs every case.
"""
from __future__ import annotations

from collections import defaultdict

import pytest
import realloc_rank_cases as rc

from planner.cost.realloc_cost import ReallocModel, realloc_recv_send
from planner.cost.transfer import transfer_plan
from planner.specs.model_spec import model_presets
from realign.realloc.checks import lower_bound_bytes
from realign.realloc.executor import messages
from realign.runtime.local_world import LocalWorld, RankFailure

pytestmark = pytest.mark.cpu_dist

WORLD = 4
L8, LL, QW = "tiny-llama-8l", "tiny-llama", "tiny-qwen"

# (model, head, src (first, n, tp, pp, dp), dst (first, n, tp, pp, dp), gpus_per_node)
CASES = [
    (L8, "lm", (0, 4, 1, 1, 4), (0, 4, 4, 1, 1), 4),     # TP1·DP4 -> TP4, same mesh
    (L8, "lm", (0, 4, 4, 1, 1), (0, 4, 1, 4, 1), 4),     # TP4 -> PP4
    (L8, "lm", (0, 4, 2, 2, 1), (0, 4, 1, 1, 4), 4),
    (L8, "lm", (0, 2, 2, 1, 1), (2, 2, 1, 2, 1), 4),     # disjoint
    (L8, "lm", (0, 2, 1, 2, 1), (2, 2, 2, 1, 1), 4),     # disjoint
    (L8, "lm", (0, 4, 2, 1, 2), (2, 2, 2, 1, 1), 4),     # dst nested in src
    (L8, "lm", (0, 2, 2, 1, 1), (0, 4, 4, 1, 1), 4),     # src nested in dst
    (L8, "lm", (0, 1, 1, 1, 1), (0, 4, 1, 1, 4), 4),     # one -> DP4
    (L8, "lm", (0, 4, 1, 4, 1), (3, 1, 1, 1, 1), 4),     # PP4 -> one GPU
    (L8, "lm", (0, 4, 4, 1, 1), (0, 4, 4, 1, 1), 4),     # equal: all local
    (L8, "lm", (0, 4, 1, 2, 2), (0, 4, 2, 2, 1), 4),
    (L8, "lm", (0, 4, 2, 2, 1), (0, 4, 2, 1, 2), 4),
    (L8, "value", (2, 2, 1, 2, 1), (0, 4, 4, 1, 1), 4),  # critic, overlapping
    (L8, "lm", (0, 4, 2, 1, 2), (0, 4, 1, 1, 4), 2),     # two nodes of 2: locality
    (QW, "lm", (0, 4, 1, 1, 4), (0, 4, 1, 4, 1), 4),     # tied embeddings PP1 -> PP4
    (QW, "lm", (0, 4, 2, 2, 1), (0, 4, 1, 1, 4), 4),     # tied PP2 -> PP1
    (QW, "lm", (0, 2, 1, 2, 1), (2, 2, 2, 1, 1), 4),     # tied, disjoint
    (QW, "lm", (0, 4, 2, 2, 1), (0, 2, 1, 2, 1), 4),     # tied, nested
    (QW, "value", (0, 4, 2, 1, 2), (0, 4, 1, 2, 2), 4),
    (QW, "lm", (0, 4, 1, 2, 2), (0, 4, 2, 2, 1), 2),     # tied, two nodes
    (LL, "lm", (0, 2, 2, 1, 1), (1, 3, 1, 1, 3), 4),     # partial overlap, odd mesh
    (LL, "value", (0, 4, 1, 4, 1), (0, 4, 2, 1, 2), 4),
    (LL, "lm", (0, 4, 2, 2, 1), (2, 2, 1, 2, 1), 4),
    (LL, "lm", (1, 1, 1, 1, 1), (0, 4, 2, 2, 1), 4),     # one rank feeds all
]


def _ids(c):
    m, h, s, d, g = c
    return f"{m}-{h}-s{'.'.join(map(str, s))}-d{'.'.join(map(str, d))}-gpn{g}"


@pytest.fixture(scope="module")
def world():
    with LocalWorld(WORLD, threads=1, timeout_s=60) as w:
        yield w


@pytest.mark.parametrize("c", CASES, ids=[_ids(c) for c in CASES])
def test_reallocation_bit_exact_and_at_lower_bound(world, c):
    model, head, s, d, gpn = c
    spec = model_presets()[model]
    src, dst = rc.placement(*s), rc.placement(*d)
    res = world.run(rc.case, model, head, s, d, gpn)
    for r in res:
        assert r["dst_bad"] == [], f"gpu {r['gpu']}: wrong after A->B: {r['dst_bad']}"
        assert r["back_bad"] == [], f"gpu {r['gpu']}: A->B->A differs: {r['back_bad']}"
        assert r["src_touched"] == [], f"gpu {r['gpu']}: source modified"
    for key, (a, b) in (("fwd", (src, dst)), ("bwd", (dst, src))):
        plan = transfer_plan(spec, head, a, b, gpn, 4)
        bound = lower_bound_bytes(spec, head, a, b, 4)
        sent = [r[key][0] for r in res]
        recv = [r[key][1] for r in res]
        # each destination receives exactly what it lacks, nothing more
        assert {g: recv[g] for g in bound} == bound
        assert sum(recv) == sum(sent) == plan.bytes_moved() == sum(bound.values())
        assert all(recv[g] == 0 for g in range(WORLD) if g not in b.mesh.gpus)
        # the planner's closed-form cost prices exactly the bytes moved, per GPU
        acc = realloc_recv_send(ReallocModel.of(spec, head, 4),
                                (a.mesh.first_gpu, a.mesh.n_gpus, a.layout.tp, a.layout.pp,
                                 a.layout.dp),
                                (b.mesh.first_gpu, b.mesh.n_gpus, b.layout.tp, b.layout.pp,
                                 b.layout.dp), gpn)
        assert {g: sum(v) for g, v in acc.recv.items() if sum(v)} == \
            {g: n for g, n in enumerate(recv) if n}
        # tiny models: every slice is below the direct threshold, so exactly one
        # message per (sender, receiver) pair
        pairs = defaultdict(list)
        for cp in plan.remote:
            pairs[cp.src_gpu, cp.dst_gpu].append(cp)
        assert all(messages(cs) == [cs] for cs in pairs.values())
        assert [r[key][4] for r in res] == [len({s for s, d in pairs if d == g})
                                            for g in range(WORLD)]
        assert sum(r[key][3] for r in res) == len(pairs)


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("c", [CASES[0], CASES[4], CASES[8], CASES[14], CASES[20]], ids=_ids)
def test_direct_messages_for_large_slices(world, c, strided):
    """With a 256-byte threshold most slices travel as their own zero-copy message
    (or through a temporary when a shard is strided): still bit-exact, same bytes."""
    model, head, s, d, gpn = c
    spec = model_presets()[model]
    res = world.run(rc.case, model, head, s, d, gpn, 256, strided)
    for r in res:
        assert r["dst_bad"] == [] and r["back_bad"] == [] and r["src_touched"] == []
    for key, (a, b) in (("fwd", (rc.placement(*s), rc.placement(*d))),
                        ("bwd", (rc.placement(*d), rc.placement(*s)))):
        plan = transfer_plan(spec, head, a, b, gpn, 4)
        assert sum(r[key][1] for r in res) == plan.bytes_moved() == \
            sum(lower_bound_bytes(spec, head, a, b, 4).values())
        pairs = defaultdict(list)
        for cp in plan.remote:
            pairs[cp.src_gpu, cp.dst_gpu].append(cp)
        n_msgs = sum(len(messages(cs, 256)) for cs in pairs.values())
        assert sum(r[key][3] for r in res) == sum(r[key][4] for r in res) == n_msgs
        if plan.remote:
            assert n_msgs > len(pairs)     # the direct path was really taken


def test_at_least_twenty_cases_cover_tp_pp_dp_and_mesh_kinds():
    assert len(CASES) >= 20
    sides = [x for c in CASES for x in (c[2], c[3])]
    assert {x[2] for x in sides} >= {1, 2, 4} and {x[3] for x in sides} >= {1, 2, 4}
    assert any(x[4] > 1 for x in sides)
    disjoint = [c for c in CASES if c[2][0] + c[2][1] <= c[3][0] or c[3][0] + c[3][1] <= c[2][0]]
    assert len(disjoint) >= 3


def test_uninvolved_ranks_need_not_call(world):
    res = world.run(rc.only_involved, L8, "lm", (0, 2, 2, 1, 1), (0, 2, 1, 1, 2))
    assert [r["called"] for r in res] == [True, True, False, False]
    assert all(r["dst_bad"] == [] for r in res)


@pytest.mark.parametrize("src,dst,model,needle", [
    ((0, 4, 1, 1, 4), (2, 4, 1, 1, 4), L8, "exceed the world's 4 ranks"),
    ((0, 4, 1, 1, 4), (0, 4, 4, 1, 1), QW, "tp=4 must divide the 2 KV heads"),
    ((0, 4, 1, 1, 4), (0, 4, 1, 1, 2), L8, "must equal the mesh size 4"),
    ((0, 4, 1, 1, 4), (0, 3, 1, 3, 1), L8, "pp=3 must divide the 8 layers"),
])
def test_bad_input_raises_on_every_rank_before_any_message(world, src, dst, model, needle):
    with pytest.raises(RankFailure) as ei:
        world.run(rc.bad_input, model, src, dst)
    errs = ei.value.errors
    assert [e.rank for e in errs] == list(range(WORLD))
    assert all(e.type_name == "ReallocError" and needle in e.message for e in errs), errs
    # nobody hung or left a message in flight: the world still works
    res = world.run(rc.case, L8, "lm", (0, 4, 2, 2, 1), (0, 4, 1, 1, 4), 4)
    assert all(r["dst_bad"] == [] for r in res)


@pytest.mark.parametrize("c", [CASES[1], CASES[3], CASES[14], CASES[20]], ids=_ids)
def test_naive_baseline_is_bit_exact_too(world, c):
    model, head, s, d, _ = c
    res = world.run(rc.naive_case, model, head, s, d)
    assert all(r["dst_bad"] == [] for r in res)


def test_released_copy_returns_memory_and_refills_bit_exact(world):
    res = world.run(rc.release_refill, QW, "lm", (0, 4, 2, 2, 1), (0, 4, 1, 4, 1))
    for r in res:
        assert r["freed"] == r["expected_bytes"] > 0
        assert r["sizes_after_release"] == [0]
        assert r["dst_bad"] == []
