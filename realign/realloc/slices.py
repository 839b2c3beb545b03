"""Local views of logical shards, and packing slices into one flat message.

Pure tensor arithmetic (no processes). A rank holds, per model replica, a dict
``{logical tensor name -> local shard}`` in :mod:`planner.specs.param_layout`'s layout:
a replicated tensor whole; a TP-sharded tensor as the concatenation, in part order,
of the ranges :meth:`LogicalTensor.shard_ranges` gives, along ``shard_dim``.

Example (SwiGLU fc1, full shape (8, h), parts=2, tp=2): TP rank 1 holds global rows
[2, 4) and [6, 8); its local shard has 4 rows; global rows [6, 8) are local rows
[2, 4), so ``shard_view(shard, t, 1, 2, 6, 8)`` is ``shard[2:4]``.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from planner.specs.param_layout import LogicalTensor


def local_range(t: LogicalTensor, tp_rank: int, tp: int, start: int, stop: int
                ) -> tuple[int, int]:
    """Global range ``[start, stop)`` along ``shard_dim`` -> range in the local shard.

    The global range must lie inside one of the ranges TP rank ``tp_rank`` holds
    (the transfer plan only produces such ranges). fc1 rows (8 total, parts=2, tp=2),
    rank 1, global [6, 8) -> local (2, 4).
    """
    offset = 0
    for lo, hi in t.shard_ranges(tp_rank, tp):
        if lo <= start and stop <= hi:
            return offset + start - lo, offset + stop - lo
        offset += hi - lo
    raise ValueError(f"{t.name}: global range [{start}, {stop}) is not held by "
                     f"tp rank {tp_rank} of {tp}")


def shard_view(shard: torch.Tensor, t: LogicalTensor, tp_rank: int, tp: int,
               dim: int | None, start: int, stop: int) -> torch.Tensor:
    """The view of ``shard`` (tp rank ``tp_rank`` of ``tp``) holding a plan slice.

    ``dim`` None means the whole (replicated) tensor, as in :class:`SliceCopy`.
    """
    if dim is None:
        return shard
    lo, hi = local_range(t, tp_rank, tp, start, stop)
    return shard.narrow(dim, lo, hi - lo)


def make_shard(full: torch.Tensor, t: LogicalTensor, tp_rank: int, tp: int) -> torch.Tensor:
    """The local shard (a new contiguous tensor) of the full tensor ``full``."""
    if t.shard_dim is None:
        return full.clone()
    pieces = [full.narrow(t.shard_dim, lo, hi - lo) for lo, hi in t.shard_ranges(tp_rank, tp)]
    return torch.cat(pieces, dim=t.shard_dim).contiguous()


def pack(views: Sequence[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """Copy ``views`` (any strides, one dtype) back to back into one flat tensor."""
    n = sum(v.numel() for v in views)
    if out is None:
        dtype = views[0].dtype if views else torch.float32
        device = views[0].device if views else "cpu"
        out = torch.empty(n, dtype=dtype, device=device)
    assert out.numel() == n and out.dim() == 1, (out.shape, n)
    off = 0
    for v in views:
        k = v.numel()
        out[off:off + k].view(v.shape).copy_(v)
        off += k
    return out


def unpack(flat: torch.Tensor, views: Sequence[torch.Tensor]) -> None:
    """Inverse of :func:`pack`: write consecutive pieces of ``flat`` into ``views``."""
    n = sum(v.numel() for v in views)
    assert flat.numel() == n and flat.dim() == 1, (flat.shape, n)
    off = 0
    for v in views:
        k = v.numel()
        v.copy_(flat[off:off + k].view(v.shape))
        off += k
