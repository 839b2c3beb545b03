"""The parameter reallocation executor: carries out :func:`planner.cost.transfer.transfer_plan`
over torch.distributed point-to-point messages (gloo on CPU, NCCL on GPU).

Why not ``megatron.core.resharding.swap_model_weights`` (megatron-core 0.16.1), which
moves weights between layouts too? Run on CPU over gloo with megatron-core 0.16.1,
it cannot do what a reallocation needs:

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
planner also prices (:mod:`planner.cost.realloc_cost`): a destination slice that a rank
already holds is copied locally, every other destination slice is sent exactly once,
and the bytes on the wire equal the lower bound (the bytes each destination lacks).

How it runs, on every rank of the world that calls it:

1. check the spec and both placements (identical on every rank, so a bad input
   raises :class:`ReallocError` everywhere before any message) and this rank's shard
   dicts (local);
2. take this rank's part of the plan (the plan is a pure function of its inputs and
   is cached keyed by all of them);
3. per peer, pack every small slice this rank sends it into one flat buffer (gloo
   pays a lot per message) and send it as one message; a large slice (>= 1 MiB by
   default) goes as its own message, straight from the source shard and into the
   destination shard on each side where it is contiguous (a whole shard, a dim-0
   range), saving the pack/unpack copies (on a 2-core CPU those cost as much as
   the transfer itself); message boundaries are a pure function of the plan
   (:func:`messages`), so no sizes are exchanged. Only point-to-point ops
   (``batch_isend_irecv``) on the given group (default: the world), so ranks outside
   ``src ∪ dst`` send and receive nothing, need not call this at all, and no new
   process groups are made (with NCCL, the group's first collective must not be
   this call, as ``batch_isend_irecv`` requires);
4. do the local copies while messages fly, then unpack each received buffer.

Shards are dicts ``{logical name -> tensor}`` in :mod:`planner.specs.param_layout`'s layout
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

from planner.cost.transfer import Placement, SliceCopy, TransferPlan, transfer_plan
from planner.specs.layout import coords_of_rank
from planner.specs.lora import LoraSpec, moved_stage_tensors
from planner.specs.model_spec import ModelSpec
from planner.specs.param_layout import LogicalTensor
from realign.realloc.checks import ReallocError, check_reallocation, check_shards, expected_shards
from realign.realloc.slices import pack, shard_view, unpack

Shards = Mapping[str, torch.Tensor]


@functools.lru_cache(maxsize=128)
def cached_plan(spec: ModelSpec, head: str, src: Placement, dst: Placement,
                gpus_per_node: int, dtype_bytes: int,
                lora: LoraSpec | None = None) -> TransferPlan:
    """:func:`transfer_plan`, cached keyed by every input (all are frozen values)."""
    return transfer_plan(spec, head, src, dst, gpus_per_node, dtype_bytes, lora)


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


#: A slice at least this large travels as its own message, received straight into
#: the destination shard and sent straight from the source shard where the slice is
#: contiguous there (a temporary copy where it is not), skipping the pack/unpack copies.
DIRECT_MIN_BYTES = 1 << 20


def messages(cs: list[SliceCopy], direct_min_bytes: int = DIRECT_MIN_BYTES
             ) -> list[list[SliceCopy]]:
    """Split one peer pair's slices (plan order) into messages: first one packed
    message with every slice under ``direct_min_bytes`` (if any), then one message
    per larger slice. A pure function of the plan, so sender and receiver agree on
    message boundaries and tags without talking.

    Example: slices of 4 KB, 2 MB, 8 KB, 3 MB with a 1 MB threshold ->
    [[4 KB, 8 KB], [2 MB], [3 MB]].
    """
    small = [c for c in cs if c.nbytes < direct_min_bytes]
    return ([small] if small else []) + [[c] for c in cs if c.nbytes >= direct_min_bytes]


@dataclass(frozen=True)
class ReallocStats:
    """What one rank did in one reallocation (payload bytes: no headers are sent)."""

    bytes_sent: int
    bytes_received: int
    bytes_local: int
    messages_sent: int
    messages_received: int


class _Side:
    """One placement as seen from one GPU: its TP rank and its tensors by name."""

    def __init__(self, spec: ModelSpec, head: str, p: Placement, gpu: int, shards: Shards | None,
                 lora: LoraSpec | None = None):
        self.shards = shards or {}
        self.tp = p.layout.tp
        self.tensors: dict[str, LogicalTensor] = {}
        if gpu in p.mesh.gpus:
            self.tp_rank, _d, pp_rank = coords_of_rank(gpu - p.mesh.first_gpu, p.layout)
            self.tensors = {t.name: t for t in moved_stage_tensors(spec, head, lora,
                                                                   p.layout.pp, pp_rank)}

    def view(self, name: str, c: SliceCopy) -> torch.Tensor:
        return shard_view(self.shards[name], self.tensors[name], self.tp_rank, self.tp,
                          c.dim, c.start, c.stop)


def reallocate(spec: ModelSpec, head: str, src: Placement, dst: Placement,
               src_shards: Shards | None, dst_shards: Shards | None, *,
               dtype: torch.dtype, gpus_per_node: int,
               rank_of_gpu: Sequence[int] | None = None,
               group: dist.ProcessGroup | None = None,
               direct_min_bytes: int = DIRECT_MIN_BYTES,
               planned: tuple[int, int] | None = None,
               lora: LoraSpec | None = None) -> ReallocStats:
    """Move ``spec``'s parameters from placement ``src`` to ``dst``; call on every rank
    of ``src ∪ dst`` (others may call it too and return at once).

    ``src_shards``: this rank's source shards (None when it is outside ``src``).
    ``dst_shards``: this rank's destination tensors, written in place (None outside
    ``dst``). ``dtype``: the parameters' dtype on every rank. ``rank_of_gpu[g]`` is the
    rank in ``group`` of global GPU ``g`` (default: rank ``g``). ``direct_min_bytes``:
    see :func:`messages` (every rank must pass the same value). ``planned``: (bytes,
    bytes per element) an execution plan priced this reallocation at; the transfer
    plan must move exactly as many elements (else :class:`ReallocError`, on every rank
    alike). Returns this rank's byte and message counts.
    """
    world = dist.get_world_size(group)
    ranks = list(range(world)) if rank_of_gpu is None else list(rank_of_gpu)
    if sorted(set(ranks)) != sorted(ranks) or any(not 0 <= r < world for r in ranks):
        raise ReallocError(f"must map GPUs to distinct ranks in 0..{world - 1}, got {ranks}",
                           field="rank_of_gpu")
    check_reallocation(spec, head, src, dst, len(ranks))
    dtype_bytes = torch.empty((), dtype=dtype).element_size()
    plan = cached_plan(spec, head, src, dst, gpus_per_node, dtype_bytes, lora)
    if planned is not None and plan.bytes_moved() * planned[1] != planned[0] * dtype_bytes:
        raise ReallocError(f"the transfer plan moves {plan.bytes_moved() // dtype_bytes} "
                           f"elements, the execution plan priced {planned[0] // planned[1]}: "
                           "the planner and the executor disagree", field="plan.reallocations")
    me = dist.get_rank(group)
    if me not in ranks:
        return ReallocStats(0, 0, 0, 0, 0)
    gpu = ranks.index(me)
    check_shards(src_shards, expected_shards(spec, head, src, gpu, lora), dtype, "src_shards")
    check_shards(dst_shards, expected_shards(spec, head, dst, gpu, lora), dtype, "dst_shards")
    sched = rank_schedule(plan, gpu)
    if sched.idle:
        return ReallocStats(0, 0, 0, 0, 0)
    s_side = _Side(spec, head, src, gpu, src_shards, lora)
    d_side = _Side(spec, head, dst, gpu, dst_shards, lora)
    held = dst_shards or src_shards
    assert held is not None, "a rank with work to do holds source or destination shards"
    device = next(iter(held.values())).device

    ops: list[dist.P2POp] = []
    recv_later: list[tuple[torch.Tensor, list[torch.Tensor]]] = []   # (buffer, views) to unpack
    n_recv = n_sent = bytes_sent = bytes_recv = 0
    for peer, cs in sorted(sched.recvs.items()):
        for tag, msg in enumerate(messages(cs, direct_min_bytes)):
            views = [d_side.view(c.dst_tensor, c) for c in msg]
            if len(views) == 1 and views[0].is_contiguous():
                buf = views[0]          # zero-copy: receive straight into the destination
            else:
                buf = torch.empty(sum(v.numel() for v in views), dtype=dtype, device=device)
                recv_later.append((buf, views))
            ops.append(dist.P2POp(dist.irecv, buf, ranks[peer], group, tag=tag))
            n_recv += 1
            bytes_recv += buf.numel() * dtype_bytes
    keep = []   # send buffers stay alive until their sends complete
    for peer, cs in sorted(sched.sends.items()):
        for tag, msg in enumerate(messages(cs, direct_min_bytes)):
            views = [s_side.view(c.src_tensor, c) for c in msg]
            buf = views[0] if len(views) == 1 and views[0].is_contiguous() else pack(views)
            keep.append(buf)
            ops.append(dist.P2POp(dist.isend, buf, ranks[peer], group, tag=tag))
            n_sent += 1
            bytes_sent += buf.numel() * dtype_bytes
    works = dist.batch_isend_irecv(ops) if ops else []

    for c in sched.local:
        d_side.view(c.dst_tensor, c).copy_(s_side.view(c.src_tensor, c))

    for w in works:
        w.wait()
    for buf, views in recv_later:
        unpack(buf, views)
    del keep
    return ReallocStats(bytes_sent=bytes_sent, bytes_received=bytes_recv,
                        bytes_local=sum(c.nbytes for c in sched.local),
                        messages_sent=n_sent, messages_received=n_recv)


def allocate_shards(spec: ModelSpec, head: str, p: Placement, gpu: int, dtype: torch.dtype,
                    device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Empty destination shards of placement ``p`` on ``gpu`` (empty dict outside it)."""
    return {name: torch.empty(shape, dtype=dtype, device=device)
            for name, shape in expected_shards(spec, head, p, gpu).items()}
