"""The naive reallocation, kept as the benchmark's baseline: gather the full weights
on one rank, then send them whole to every destination rank, which cuts its shards.

1. every source rank of data-parallel replica 0 packs all its shards into one buffer
   and sends it to the root (the source mesh's first GPU), which assembles the full
   tensors;
2. the root sends the full model (one flat buffer) to every other destination rank
   (gloo's broadcast is the same one-to-all pattern);
3. each destination rank copies its shards out of the full model.

Same inputs and in-place semantics as :func:`realign.realloc.executor.reallocate`, and
bit-exact too (a test checks it), so the benchmark compares like with like.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from planner.cost.transfer import Placement
from planner.specs.layout import coords_of_rank
from planner.specs.model_spec import ModelSpec
from planner.specs.param_layout import LogicalTensor, all_tensors, stage_tensors
from realign.realloc.checks import check_reallocation
from realign.realloc.executor import Shards
from realign.realloc.slices import pack, unpack


def _coords(p: Placement, gpu: int) -> tuple[int, int, int] | None:
    return coords_of_rank(gpu - p.mesh.first_gpu, p.layout) if gpu in p.mesh.gpus else None


def _full_views(flat: torch.Tensor, full: list[LogicalTensor]) -> dict[str, torch.Tensor]:
    out, off = {}, 0
    for t in full:
        out[t.content] = flat[off:off + t.numel].view(t.shape)
        off += t.numel
    return out


def naive_reallocate(spec: ModelSpec, head: str, src: Placement, dst: Placement,
                     src_shards: Shards | None, dst_shards: Shards | None, *,
                     dtype: torch.dtype) -> int:
    """Gather-then-broadcast reallocation over the world group (rank = GPU).

    Returns the bytes this rank received.
    """
    check_reallocation(spec, head, src, dst, dist.get_world_size())
    gpu = dist.get_rank()
    root = src.mesh.first_gpu
    full = all_tensors(spec, head)
    n_full = sum(t.numel for t in full)
    received = 0
    flat: torch.Tensor | None = None

    # 1. gather on the root
    senders = [g for g in src.mesh.gpus
               if coords_of_rank(g - src.mesh.first_gpu, src.layout)[1] == 0]
    me = _coords(src, gpu)
    if gpu in senders and gpu != root:
        assert me is not None and src_shards is not None, "a sender holds source shards"
        mine = [src_shards[t.name] for t in stage_tensors(spec, head, src.layout.pp, me[2])]
        dist.send(pack(mine), root)
    if gpu == root:
        flat = torch.empty(n_full, dtype=dtype)
        by_content = _full_views(flat, full)
        for g in senders:
            k, _d, j = coords_of_rank(g - src.mesh.first_gpu, src.layout)
            ts = stage_tensors(spec, head, src.layout.pp, j)
            if g == root:
                assert src_shards is not None, "the root holds source shards"
                shards = [src_shards[t.name] for t in ts]
            else:
                shards = [torch.empty(t.shard_shape(src.layout.tp), dtype=dtype) for t in ts]
                buf = torch.empty(sum(s.numel() for s in shards), dtype=dtype)
                dist.recv(buf, g)
                received += buf.numel() * buf.element_size()
                unpack(buf, shards)
            for t, s in zip(ts, shards):
                _write_shard(by_content[t.content], s, t, k, src.layout.tp)

    # 2. root -> every destination
    if gpu == root:
        assert flat is not None
        works = [dist.isend(flat, g) for g in dst.mesh.gpus if g != root]
        for w in works:
            assert w is not None, "isend over the world group returns its request"
            w.wait()
    elif gpu in dst.mesh.gpus:
        flat = torch.empty(n_full, dtype=dtype)
        dist.recv(flat, root)
        received += flat.numel() * flat.element_size()

    # 3. cut the destination shards
    d = _coords(dst, gpu)
    if d is not None:
        assert flat is not None and dst_shards is not None, "a destination received the model"
        by_content = _full_views(flat, full)
        for t in stage_tensors(spec, head, dst.layout.pp, d[2]):
            _read_shard(by_content[t.content], dst_shards[t.name], t, d[0], dst.layout.tp)
    return received


def _read_shard(full: torch.Tensor, shard: torch.Tensor, t: LogicalTensor, k: int,
                tp: int) -> None:
    """Copy TP rank ``k``'s ranges of ``full`` into ``shard`` (one copy, no temporary)."""
    if t.shard_dim is None:
        shard.copy_(full)
        return
    off = 0
    for lo, hi in t.shard_ranges(k, tp):
        shard.narrow(t.shard_dim, off, hi - lo).copy_(full.narrow(t.shard_dim, lo, hi - lo))
        off += hi - lo


def _write_shard(full: torch.Tensor, shard: torch.Tensor, t: LogicalTensor, k: int,
                 tp: int) -> None:
    if t.shard_dim is None:
        full.copy_(shard)
        return
    off = 0
    for lo, hi in t.shard_ranges(k, tp):
        full.narrow(t.shard_dim, lo, hi - lo).copy_(shard.narrow(t.shard_dim, off, hi - lo))
        off += hi - lo
