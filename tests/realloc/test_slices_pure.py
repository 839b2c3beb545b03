"""Pure tier: shard views, pack/unpack, rank schedules, the lower bound, offload.

No processes; tensors are tiny.
"""
from __future__ import annotations

import pytest
import torch

from planner.cost.transfer import Placement, transfer_plan
from planner.specs.layout import Layout
from planner.specs.mesh import DeviceMesh
from planner.specs.model_spec import model_presets
from planner.specs.param_layout import LogicalTensor, all_tensors
from realign.realloc import offload as off
from realign.realloc.checks import (
    ReallocError,
    check_reallocation,
    check_shards,
    expected_shards,
    lower_bound_bytes,
)
from realign.realloc.executor import allocate_shards, messages, rank_schedule
from realign.realloc.slices import local_range, make_shard, pack, shard_view, unpack
from realign.realloc.synthetic import full_weights, shards_of

pytestmark = pytest.mark.pure

FC1 = LogicalTensor("fc1", (8, 3), 0, 2, "fc1", 0)
PROJ = LogicalTensor("proj", (3, 8), 1, 1, "proj", 0)
NORM = LogicalTensor("norm", (3,), None, 1, "norm", 0)


def pl(first, n, tp, pp, dp):
    return Placement(DeviceMesh(first_gpu=first, n_gpus=n), Layout(tp=tp, pp=pp, dp=dp))


def test_fc1_shard_is_parts_concatenated_in_order():
    full = torch.arange(24.).view(8, 3)
    s = make_shard(full, FC1, 1, 2)                       # rows [2,4) and [6,8)
    assert torch.equal(s, torch.cat([full[2:4], full[6:8]]))
    assert FC1.shard_shape(2) == (4, 3)
    assert local_range(FC1, 1, 2, 6, 8) == (2, 4)
    assert local_range(FC1, 1, 2, 3, 4) == (1, 2)
    v = shard_view(s, FC1, 1, 2, 0, 6, 8)
    assert torch.equal(v, full[6:8]) and v.data_ptr() == s[2:].data_ptr()  # a view
    with pytest.raises(ValueError, match="not held"):
        local_range(FC1, 1, 2, 3, 7)


def test_dim1_view_and_replicated_whole():
    full = torch.arange(24.).view(3, 8)
    s = make_shard(full, PROJ, 3, 4)
    assert torch.equal(s, full[:, 6:8])
    assert torch.equal(shard_view(s, PROJ, 3, 4, 1, 7, 8), full[:, 7:8])
    n = torch.arange(3.)
    assert shard_view(n, NORM, 0, 4, None, 0, 0) is n


def test_pack_unpack_roundtrip_with_strided_views():
    a = torch.arange(24.).view(4, 6)
    views = [a[:, 1:3], a[2:3], a[:, 5:6]]                # non-contiguous included
    flat = pack(views)
    assert flat.tolist() == ([1., 2., 7., 8., 13., 14., 19., 20.] + list(range(12, 18))
                             + [5., 11., 17., 23.])
    b = torch.zeros(4, 6)
    unpack(flat, [b[:, 1:3], b[2:3], b[:, 5:6]])
    mask = torch.zeros(4, 6, dtype=torch.bool)
    mask[:, 1:3] = mask[2] = mask[:, 5] = True
    assert torch.equal(b[mask], a[mask]) and (b[~mask] == 0).all()
    out = torch.empty(flat.numel())
    assert pack(views, out) is out and torch.equal(out, flat)


def test_rank_schedule_orders_match_between_peers():
    spec = model_presets()["tiny-llama-8l"]
    plan = transfer_plan(spec, "lm", pl(0, 4, 4, 1, 1), pl(0, 4, 1, 4, 1), 4, 4)
    scheds = {g: rank_schedule(plan, g) for g in range(4)}
    for g, s in scheds.items():
        for peer, cs in s.sends.items():
            assert scheds[peer].recvs[g] == cs            # same slices, same order
        assert all(c.dst_gpu == g for c in s.local)
    assert sum(len(s.local) for s in scheds.values()) == len([c for c in plan.copies
                                                              if c.is_local])


def test_messages_pack_small_slices_and_send_large_ones_alone():
    from planner.cost.transfer import SliceCopy
    def sc(dim, nbytes):
        return SliceCopy(0, 1, "t", "t", dim, 0, 1, nbytes)
    a, b, c, d, e = sc(1, 4096), sc(0, 2 << 20), sc(0, 8192), sc(None, 3 << 20), sc(1, 5 << 20)
    assert messages([a, b, c, d, e], 1 << 20) == [[a, c], [b], [d], [e]]
    assert messages([b, d], 1 << 20) == [[b], [d]]
    assert messages([a, c], 1 << 20) == [[a, c]]
    assert messages([], 1 << 20) == []


@pytest.mark.parametrize("head", ["lm", "value"])
@pytest.mark.parametrize("model", ["tiny-llama-8l", "tiny-qwen"])
@pytest.mark.parametrize("src,dst", [
    (pl(0, 4, 1, 1, 4), pl(0, 4, 2, 2, 1)), (pl(0, 2, 2, 1, 1), pl(2, 2, 1, 2, 1)),
    (pl(0, 4, 2, 2, 1), pl(0, 4, 2, 2, 1)), (pl(0, 1, 1, 1, 1), pl(0, 2, 2, 1, 1)),
    (pl(0, 4, 1, 2, 2), pl(0, 2, 1, 1, 2)),
])
def test_transfer_plan_reaches_the_independent_lower_bound(model, head, src, dst):
    spec = model_presets()[model]
    plan = transfer_plan(spec, head, src, dst, 4, 2)
    bound = lower_bound_bytes(spec, head, src, dst, 2)
    per_dst = {g: 0 for g in dst.mesh.gpus}
    for c in plan.remote:
        per_dst[c.dst_gpu] += c.nbytes
    assert per_dst == bound


def test_lower_bound_examples():
    spec = model_presets()["tiny-llama"]
    total = sum(t.numel for t in all_tensors(spec, "lm")) * 4
    # equal placements: nothing lacks; fresh disjoint mesh of one: everything
    assert set(lower_bound_bytes(spec, "lm", pl(0, 2, 2, 1, 1), pl(0, 2, 2, 1, 1), 4).values()) == {0}
    assert lower_bound_bytes(spec, "lm", pl(0, 2, 2, 1, 1), pl(2, 1, 1, 1, 1), 4) == {2: total}
    # TP2 -> TP1 on rank 0: lacks the other half of every sharded tensor
    half = sum(t.numel for t in all_tensors(spec, "lm") if t.shard_dim is not None) * 2
    assert lower_bound_bytes(spec, "lm", pl(0, 2, 2, 1, 1), pl(0, 1, 1, 1, 1), 4) == {0: half}


def test_checks_name_the_field_and_what_is_allowed():
    spec = model_presets()["tiny-qwen"]
    with pytest.raises(ReallocError, match=r"^dst: .*tp=4 must divide the 2 KV heads"):
        check_reallocation(spec, "lm", pl(0, 4, 1, 1, 4), pl(0, 4, 4, 1, 1), 4)
    with pytest.raises(ReallocError, match=r"^src: mesh GPUs 4..7 exceed the world's 4"):
        check_reallocation(spec, "lm", pl(4, 4, 1, 1, 4), pl(0, 4, 1, 1, 4), 4)
    with pytest.raises(ReallocError, match="head 'critic' is not one of"):
        check_reallocation(spec, "critic", pl(0, 4, 1, 1, 4), pl(0, 4, 1, 1, 4), 4)
    exp = expected_shards(spec, "lm", pl(0, 2, 2, 1, 1), 1)
    good = allocate_shards(spec, "lm", pl(0, 2, 2, 1, 1), 1, torch.float32)
    check_shards(good, exp, torch.float32, "dst_shards")
    with pytest.raises(ReallocError, match=r"missing \['embedding.word_embeddings.weight'\]"):
        check_shards({k: v for k, v in good.items() if "embedding" not in k}, exp,
                     torch.float32, "dst_shards")
    with pytest.raises(ReallocError, match=r"dst_shards\['decoder.final_layernorm.weight'\]"):
        check_shards({**good, "decoder.final_layernorm.weight": torch.empty(3)}, exp,
                     torch.float32, "dst_shards")
    with pytest.raises(ReallocError, match="torch.bfloat16"):
        check_shards(good, exp, torch.bfloat16, "dst_shards")


def test_synthetic_tied_copy_equals_embedding():
    spec = model_presets()["tiny-qwen"]
    full = full_weights(spec, "lm", seed=3)
    first = shards_of(full, spec, "lm", pl(0, 2, 1, 2, 1), 0)
    last = shards_of(full, spec, "lm", pl(0, 2, 1, 2, 1), 1)
    assert torch.equal(first["embedding.word_embeddings.weight"], last["output_layer.weight"])
    assert not torch.equal(full_weights(spec, "lm", seed=4)["embedding"], full["embedding"])


def test_release_restore_frees_and_keeps_the_storage_identity():
    flat = torch.randn(100)
    views = [flat[:40].view(4, 10), flat[40:]]             # one storage, two views
    other = torch.randn(7)
    rel = off.release(views + [other])
    assert rel.total_bytes == 107 * 4 and len(rel.storages) == 2
    assert flat.untyped_storage().nbytes() == 0 == other.untyped_storage().nbytes()
    off.restore(rel)
    assert flat.untyped_storage().nbytes() == 400
    views[0].fill_(1.0)
    assert (flat[:40] == 1).all()                          # views still alias the storage
    with pytest.raises(RuntimeError, match="not released"):
        off.restore(rel)


def test_offload_reload_bit_identical_same_storage():
    spec = model_presets()["tiny-qwen"]
    full = full_weights(spec, "lm", seed=5)
    shards = shards_of(full, spec, "lm", pl(0, 2, 2, 1, 1), 1)
    want = {n: t.clone() for n, t in shards.items()}
    views = {n: t[...] for n, t in shards.items()}
    ptr_ids = {n: t.untyped_storage()._cdata for n, t in shards.items()}
    o = off.offload(views.values())
    assert o.total_bytes == sum(t.numel() * 4 for t in want.values())
    assert all(t.untyped_storage().nbytes() == 0 for t in shards.values())
    assert all(h.device.type == "cpu" for h in o.host)
    off.reload(o)
    for n, t in shards.items():
        assert t.untyped_storage()._cdata == ptr_ids[n]
        assert torch.equal(t.view(torch.int32), want[n].view(torch.int32))
        assert torch.equal(views[n].view(torch.int32), want[n].view(torch.int32))
