"""The parameter reallocation executor: carries out :func:`planner.transfer.transfer_plan`
over torch.distributed point-to-point messages (gloo on CPU, NCCL on GPU).

Why not ``megatron.core.resharding.swap_model_weights`` (megatron-core 0.16.1), which
moves weights between layouts too? Measured here (see ENVIRONMENT.md) it cannot do
what a reallocation needs:

* it picks senders without regard to what the receiver already holds or where it is
  (TP1·DP2 -> TP2 on the same two ranks sent 297 KB although each rank held all it
  needed; TP1 -> TP4 sent everything from rank 0), so it does not reach the byte
  lower bound, and it has no notion of node locality;
* it caches its plan on the target module keyed by nothing, so swapping in a source
  of another layout silently leaves parameters wrong;
* tied embeddings PP1 -> PP2 fail (``output_layer.weight`` not found in the source);
* its stock gloo copy service creates a ``torch.cuda.Stream`` and fails on CPU;
* every rank of the world must call it (world-wide gather, broadcast, barrier).

So this executor follows the planner's transfer plan, the one source of truth the
planner also prices (:mod:`planner.realloc_cost`): a destination slice that a rank
already holds is copied locally, every other destination slice is sent exactly once,
and the bytes on the wire equal the lower bound (the bytes each destination lacks).

How it runs, on every rank of the world that calls it:

1. check the spec and both placements (identical on every rank, so a bad input
   raises :class:`ReallocError` everywhere before any message) and this rank's shard
   dicts (local);
2. take this rank's part of the plan (the plan is a pure function of its inputs and
   is cached keyed by all of them);
3. per peer, pack every slice this rank sends it into one flat buffer (gloo pays a
   lot per message) and post one send; post one receive per peer it receives from;
   only point-to-point ops on the given group (default: the world), so ranks outside
   ``src ∪ dst`` send and receive nothing, need not call this at all, and no new
   process groups are made;
4. do the local copies while messages fly, then unpack each received buffer.

Shards are dicts ``{logical name -> tensor}`` in :mod:`planner.param_layout`'s layout
(see :mod:`realign.realloc.slices`); destination tensors are written in place with
``copy_`` (views of a model's parameters are fine) and must not share storage with
the source tensors. Source tensors are only read: a trained copy keeps its values
and its optimizer state.

A rank whose own shard dict is wrong raises before it sends anything; its peers then
block in their receives until the process group's timeout. Such an error is a bug in
the caller on that rank, not a user input error (those are caught everywhere).
"""
from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from planner.layout import coords_of_rank
from planner.model_spec import ModelSpec
from planner.param_layout import LogicalTensor, stage_tensors
from planner.transfer import Placement, SliceCopy, TransferPlan, transfer_plan
from realign.realloc.checks import (ReallocError, check_reallocation, check_shards,
                                    expected_shards)
from realign.realloc.slices import pack, shard_view, unpack

Shards = Mapping[str, torch.Tensor]


@functools.lru_cache(maxsize=128)
def cached_plan(spec: ModelSpec, head: str, src: Placement, dst: Placement,
                gpus_per_node: int, dtype_bytes: int) -> TransferPlan:
    """:func:`transfer_plan`, cached keyed by every input (all are frozen values)."""
    return transfer_plan(spec, head, src, dst, gpus_per_node, dtype_bytes)


@dataclass
class RankSchedule:
    """One GPU's part of a transfer plan, in plan order (the packing order)."""

    local: list[SliceCopy] = field(default_factory=list)
    sends: dict[int, list[SliceCopy]] = field(default_factory=dict)   #: dst gpu -> slices
    recvs: dict[int, list[SliceCopy]] = field(default_factory=dict)   #: src gpu -> slices

    @property
    def idle(self) -> bool:
        return not (self.local or self.sends or self.recvs)


def rank_schedule(plan: TransferPlan, gpu: int) -> RankSchedule:
    """The slices ``gpu`` copies locally, sends per peer and receives per peer.

    Sender and receiver both keep plan order, so the receiver unpacks a peer's buffer
    in the order the sender packed it.
    """
    sends: dict[int, list[SliceCopy]] = defaultdict(list)
    recvs: dict[int, list[SliceCopy]] = defaultdict(list)
    s = RankSchedule()
    for c in plan.copies:
        if c.is_local:
            if c.dst_gpu == gpu:
                s.local.append(c)
        elif c.src_gpu == gpu:
            sends[c.dst_gpu].append(c)
        elif c.dst_gpu == gpu:
            recvs[c.src_gpu].append(c)
    s.sends, s.recvs = dict(sends), dict(recvs)
    return s


@dataclass(frozen=True)
class ReallocStats:
    """What one rank did in one reallocation (payload bytes, no framing exists)."""

    bytes_sent: int
    bytes_received: int
    bytes_local: int
    messages_sent: int
    messages_received: int


class _Side:
    """One placement as seen from one GPU: its TP rank and its tensors by name."""

    def __init__(self, spec: ModelSpec, head: str, p: Placement, gpu: int, shards: Shards | None):
        self.shards = shards or {}
        self.tp = p.layout.tp
        self.tensors: dict[str, LogicalTensor] = {}
        if gpu in p.mesh.gpus:
            self.tp_rank, _d, pp_rank = coords_of_rank(gpu - p.mesh.first_gpu, p.layout)
            self.tensors = {t.name: t for t in stage_tensors(spec, head, p.layout.pp, pp_rank)}

    def view(self, name: str, c: SliceCopy) -> torch.Tensor:
        return shard_view(self.shards[name], self.tensors[name], self.tp_rank, self.tp,
                          c.dim, c.start, c.stop)


def reallocate(spec: ModelSpec, head: str, src: Placement, dst: Placement,
               src_shards: Shards | None, dst_shards: Shards | None, *,
               dtype: torch.dtype, gpus_per_node: int,
               rank_of_gpu: Sequence[int] | None = None,
               group: dist.ProcessGroup | None = None) -> ReallocStats:
    """Move ``spec``'s parameters from placement ``src`` to ``dst``; call on every rank
    of ``src ∪ dst`` (others may call it too and return at once).

    ``src_shards``: this rank's source shards (None when it is outside ``src``).
    ``dst_shards``: this rank's destination tensors, written in place (None outside
    ``dst``). ``dtype``: the parameters' dtype on every rank. ``rank_of_gpu[g]`` is the
    rank in ``group`` of global GPU ``g`` (default: rank ``g``). Returns this rank's
    byte and message counts.
    """
    world = dist.get_world_size(group)
    ranks = list(range(world)) if rank_of_gpu is None else list(rank_of_gpu)
    if sorted(set(ranks)) != sorted(ranks) or any(not 0 <= r < world for r in ranks):
        raise ReallocError(f"must map GPUs to distinct ranks in 0..{world - 1}, got {ranks}",
                           field="rank_of_gpu")
    check_reallocation(spec, head, src, dst, len(ranks))
    me = dist.get_rank(group)
    if me not in ranks:
        return ReallocStats(0, 0, 0, 0, 0)
    gpu = ranks.index(me)
    check_shards(src_shards, expected_shards(spec, head, src, gpu), dtype, "src_shards")
    check_shards(dst_shards, expected_shards(spec, head, dst, gpu), dtype, "dst_shards")

    dtype_bytes = torch.empty((), dtype=dtype).element_size()
    sched = rank_schedule(cached_plan(spec, head, src, dst, gpus_per_node, dtype_bytes), gpu)
    if sched.idle:
        return ReallocStats(0, 0, 0, 0, 0)
    s_side = _Side(spec, head, src, gpu, src_shards)
    d_side = _Side(spec, head, dst, gpu, dst_shards)
    device = next(iter((dst_shards or src_shards).values())).device

    ops: list[dist.P2POp] = []
    recv_bufs: list[tuple[torch.Tensor, list[torch.Tensor]]] = []
    for peer, cs in sorted(sched.recvs.items()):
        views = [d_side.view(c.dst_tensor, c) for c in cs]
        buf = torch.empty(sum(v.numel() for v in views), dtype=dtype, device=device)
        recv_bufs.append((buf, views))
        ops.append(dist.P2POp(dist.irecv, buf, ranks[peer], group))
    send_bufs = []
    for peer, cs in sorted(sched.sends.items()):
        buf = pack([s_side.view(c.src_tensor, c) for c in cs])
        send_bufs.append(buf)
        ops.append(dist.P2POp(dist.isend, buf, ranks[peer], group))
    works = dist.batch_isend_irecv(ops) if ops else []

    for c in sched.local:
        d_side.view(c.dst_tensor, c).copy_(s_side.view(c.src_tensor, c))

    for w in works:
        w.wait()
    for buf, views in recv_bufs:
        unpack(buf, views)
    return ReallocStats(
        bytes_sent=sum(b.numel() for b in send_bufs) * dtype_bytes,
        bytes_received=sum(b.numel() for b, _ in recv_bufs) * dtype_bytes,
        bytes_local=sum(c.nbytes for c in sched.local),
        messages_sent=len(send_bufs), messages_received=len(recv_bufs))


def allocate_shards(spec: ModelSpec, head: str, p: Placement, gpu: int, dtype: torch.dtype,
                    device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Empty destination shards of placement ``p`` on ``gpu`` (empty dict outside it)."""
    return {name: torch.empty(shape, dtype=dtype, device=device)
            for name, shape in expected_shards(spec, head, p, gpu).items()}
