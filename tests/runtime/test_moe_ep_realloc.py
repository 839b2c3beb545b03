"""Reallocation of a mixture of experts between layouts that differ in expert parallelism
(the tiny Qwen3-MoE, 8 experts, fp32): the transfer plan moves exactly the expert shards
each destination lacks (the byte lower bound), and on real gloo ranks the executor
leaves every destination tensor bit-equal to a direct load of the checkpoint at that
layout: DP2·EP2 -> DP2·EP1, DP2·EP1 -> DP2·EP2, DP2·EP2 -> TP2 and EP2 -> one rank."""
from __future__ import annotations

import pytest
import torch

# ---- cases run inside the gloo world -------------------------------------------------

#: a placement: (first GPU, tp, dp, ep)


def _replica(spec, path, place, load: bool):
    from planner.specs.layout import Layout
    from planner.specs.mesh import DeviceMesh
    from realign.runtime.device import init_device
    from realign.runtime.groups import build_replica_groups
    from realign.runtime.hf_checkpoint import HFReader, load_hf_weights
    from realign.runtime.model import build_model

    first, tp, dp, ep = place
    groups = build_replica_groups(spec, DeviceMesh(first_gpu=first, n_gpus=tp * dp),
                                  Layout(tp=tp, dp=dp, ep=ep))
    if not groups.member:
        return groups, None
    shard = build_model(spec, "lm", groups, init_device("cpu", dtype="fp32"),
                        init_weights=False)
    if load:
        load_hf_weights(shard, path, HFReader(path))
    return groups, shard


def realloc_vs_direct(ctx, path, src, dst):
    """Reallocate a replica loaded at ``src`` into a NaN-filled one at ``dst``: (names
    of this rank's destination tensors that differ from a direct load at ``dst``, the
    expert tensors it holds there, bytes received, bytes copied locally)."""
    from realign.runtime.hf_checkpoint import spec_from_hf
    from realign.runtime.realloc_glue import reallocate_replica, shard_tensors

    spec = spec_from_hf(path)
    src_g, src_shard = _replica(spec, path, src, load=True)
    dst_g, dst_shard = _replica(spec, path, dst, load=False)
    _, direct = _replica(spec, path, dst, load=True)
    for t in (shard_tensors(dst_shard) or {}).values():
        t.fill_(float("nan"))
    stats = reallocate_replica(spec, "lm", src_g, dst_g, src_shard, dst_shard,
                               dtype=torch.float32, gpus_per_node=8)
    if dst_shard is None:
        return None
    got, want = shard_tensors(dst_shard), shard_tensors(direct)
    assert got is not None and want is not None and sorted(got) == sorted(want)
    differ = sorted(n for n in got if not torch.equal(got[n], want[n]))
    experts = sorted(n for n in got if ".local_experts." in n)
    return differ, experts, stats.bytes_received, stats.bytes_local


# ---- tests ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    from realign.assets.tiny import TINY_QWEN3_MOE, make_model

    return str(make_model(tmp_path_factory.mktemp("moe_ep_realloc") / "moe", "qwen3_moe",
                          seed=13, arch=dict(TINY_QWEN3_MOE)))


def _expert_bytes(spec) -> int:
    """Bytes of one expert (fc1 and fc2, fp32)."""
    from planner.specs.param_layout import expert_tensors

    layer = next(i for i in range(spec.n_layers) if spec.is_sparse(i))
    return sum(t.numel for t in expert_tensors(spec, layer)[1:3]) * 4


@pytest.mark.torch
@pytest.mark.parametrize("src,dst", [((0, 1, 2, 2), (0, 1, 2, 1)), ((0, 1, 2, 1), (0, 1, 2, 2)),
                                     ((0, 1, 2, 2), (0, 2, 1, 1)), ((0, 1, 4, 2), (4, 1, 4, 4))])
def test_transfer_plan_moves_the_missing_experts_only(moe_path, src, dst):
    """The plan's bytes equal the lower bound; DP2·EP2 -> DP2·EP1 on the same GPUs moves
    exactly the other EP rank's experts to each GPU, and nothing the other way."""
    from planner.cost.transfer import Placement, held_tensors, transfer_plan
    from planner.specs.layout import Layout
    from planner.specs.mesh import DeviceMesh
    from realign.realloc.checks import lower_bound_bytes
    from realign.runtime.hf_checkpoint import spec_from_hf

    spec = spec_from_hf(moe_path)

    def place(p):
        first, tp, dp, ep = p
        return Placement(DeviceMesh(first_gpu=first, n_gpus=tp * dp), Layout(tp=tp, dp=dp, ep=ep))

    a, b = place(src), place(dst)
    plan = transfer_plan(spec, "lm", a, b, 8, 4)
    bound = lower_bound_bytes(spec, "lm", a, b, 4)
    assert plan.bytes_moved() == sum(bound.values())
    for gpu, _i, d, j in b.gpu_coords():
        names = {t.name for t in held_tensors(spec, "lm", None, b.layout, d, j)}
        got = {c.dst_tensor for c in plan.copies if c.dst_gpu == gpu}
        assert got == names, gpu        # every tensor it holds, no other
    sparse = sum(spec.is_sparse(i) for i in range(spec.n_layers))
    half = sparse * spec.moe.n_experts // 2 * _expert_bytes(spec)
    if (src, dst) == ((0, 1, 2, 2), (0, 1, 2, 1)):
        assert bound == {0: half, 1: half}
    if (src, dst) == ((0, 1, 2, 1), (0, 1, 2, 2)):
        assert bound == {0: 0, 1: 0}       # each keeps a half of what it held


@pytest.mark.cpu_dist
@pytest.mark.parametrize("src,dst", [((0, 1, 2, 2), (0, 1, 2, 1)), ((0, 1, 2, 1), (0, 1, 2, 2)),
                                     ((0, 1, 2, 2), (0, 2, 1, 1)), ((0, 1, 2, 2), (1, 1, 1, 1))])
def test_reallocation_across_ep_equals_a_direct_load(world2, moe_path, src, dst):
    from realign.runtime.hf_checkpoint import spec_from_hf

    spec = spec_from_hf(moe_path)
    got = [r for r in world2.run("test_moe_ep_realloc:realloc_vs_direct", moe_path, src, dst)
           if r is not None]
    first, tp, dp, ep = dst
    assert len(got) == tp * dp
    sparse = sum(spec.is_sparse(i) for i in range(spec.n_layers))
    for differ, experts, _received, _local in got:
        assert differ == [], differ
        # fc1 and fc2 of each of the rank's experts in every sparse layer
        assert len(experts) == 2 * sparse * spec.moe.n_experts // ep
    if (src, dst) == ((0, 1, 2, 2), (0, 1, 2, 1)):
        # each rank receives the other EP rank's experts: the byte lower bound
        half = sparse * spec.moe.n_experts // 2 * _expert_bytes(spec)
        assert [r[2] for r in got] == [half, half]
    if (src, dst) == ((0, 1, 2, 1), (0, 1, 2, 2)):
        assert [r[2] for r in got] == [0, 0]
