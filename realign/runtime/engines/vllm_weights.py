"""A replica's weights into its vLLM engine in memory, in bounded buckets: no files.

One interface, :class:`WeightTransport` (``begin``, ``send`` one bucket, ``end``), and
one driver, :func:`push_weights`, shared by every transport:

* the replica's weights as vLLM reads a checkpoint: Hugging Face names, whole tensors
  (:func:`weight_groups`, :func:`group_tensors`). At TP > 1 each logical tensor is
  gathered over the replica's own TP group (the reallocation has already brought the
  weights to the generate call's layout), one bucket at a time, so every TP rank of
  the replica runs the same gathers in the same order;
* buckets of whole layers (:func:`plan_buckets`): vLLM fuses a layer's q/k/v and
  gate/up tensors and processes a layer once all of its tensors have arrived, keeping
  references to what it was handed until then, so a bucket never splits a layer. A
  bucket holds at most ``bucket_bytes``, or one layer alone where a layer is larger:
  the extra memory is :func:`bucket_capacity` bytes for the packed bucket plus the
  same again for one bucket's gathered tensors (the transports state their own);
* the packing (:func:`pack_into`, :func:`unpack`): tensors back to back in one byte
  buffer, no padding, the layout vLLM's own packed weight transfer unpacks
  (``vllm.distributed.weight_transfer.packed_tensor.unpack_tensor``).

Transports: :class:`SharedMemoryTransport` here (CPU: the bucket is a named POSIX
shared-memory segment the engine's worker processes map; the worker extension
:mod:`realign.runtime.engines.vllm_worker_ext` hands views of it to the model's
loader); CUDA IPC and NCCL broadcast in :mod:`realign.runtime.engines.vllm_cuda_weights`.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from planner.specs.param_layout import LogicalTensor, stage_tensors

if TYPE_CHECKING:
    from realign.runtime.model import ModelShard

#: default bucket: what one transfer step packs at most (a larger layer goes alone)
BUCKET_BYTES = 256 * 2 ** 20


@dataclass(frozen=True)
class Packed:
    """Where one tensor sits in a packed bucket (``offset`` bytes from its start)."""

    name: str
    dtype: str          #: torch dtype name, e.g. ``float32``
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def plan_buckets(group_bytes: list[int], bucket_bytes: int) -> list[list[int]]:
    """Consecutive groups (layers) per bucket: as many as fit in ``bucket_bytes``; a
    group larger than that fills a bucket alone.

    Example: groups of 4, 4, 9, 2, 2 bytes in buckets of 8: ``[[0, 1], [2], [3, 4]]``."""
    out: list[list[int]] = []
    used = 0
    for i, n in enumerate(group_bytes):
        if out and used + n <= bucket_bytes:
            out[-1].append(i)
            used += n
        else:
            out.append([i])
            used = n
    return out


def bucket_capacity(group_bytes: list[int], bucket_bytes: int) -> int:
    """Bytes a bucket buffer needs: ``bucket_bytes``, or the largest group if larger
    (0 for no groups). Example: groups of 4, 9 bytes, buckets of 8: 9."""
    return max([bucket_bytes, *group_bytes]) if group_bytes else 0


def pack_into(buffer: torch.Tensor, tensors: list[tuple[str, torch.Tensor]]) -> list[Packed]:
    """Copy ``tensors`` back to back into the byte tensor ``buffer`` (any device);
    where each went. Raises if they do not fit.

    Example: an fp32 (2, 3) and a bf16 (4,) tensor -> offsets 0 and 24, 32 bytes used."""
    out, at = [], 0
    for name, t in tensors:
        flat = t.detach().contiguous().view(-1).view(torch.uint8)
        n = flat.numel()
        if at + n > buffer.numel():
            raise ValueError(f"{name} ({n} bytes) does not fit in the bucket: {at} of "
                             f"{buffer.numel()} bytes used")
        buffer[at:at + n].copy_(flat)
        out.append(Packed(name, str(t.dtype).removeprefix("torch."), tuple(t.shape), at, n))
        at += n
    return out


def unpack(buffer: torch.Tensor, entries: list[Packed]) -> list[tuple[str, torch.Tensor]]:
    """Views of ``buffer`` (a byte tensor) as the tensors :func:`pack_into` put there:
    no copy."""
    return [(e.name, buffer[e.offset:e.offset + e.nbytes].view(getattr(torch, e.dtype))
             .view(e.shape)) for e in entries]


# ---- the replica's weights as a checkpoint ----------------------------------------------

def weight_groups(shard: "ModelShard") -> list[list[LogicalTensor]]:
    """The replica's logical tensors (PP 1) grouped as vLLM processes them: the
    embedding, then each decoder layer, then the final norm with the output layer (a
    tied output layer is the embedding: left out)."""
    assert shard.groups.layout.pp == 1, "vLLM takes the whole model on each TP rank (PP 1)"
    groups: dict[object, list[LogicalTensor]] = {}
    for t in stage_tensors(shard.spec, shard.head, 1, 0):
        if t.name == "output_layer.weight" and t.content == "embedding":
            continue
        key = t.layer if t.layer is not None else ("pre" if not groups else "post")
        groups.setdefault(key, []).append(t)
    return list(groups.values())


def group_bytes(shard: "ModelShard", group: list[LogicalTensor], elem_bytes: int) -> int:
    """Bytes of ``group`` in Hugging Face form (the vocabulary padding left out)."""
    from realign.runtime.hf_checkpoint import hf_shapes

    n = 0
    for t in group:
        for shape in hf_shapes(t, shard.spec):
            k = 1
            for s in shape:
                k *= s
            n += k
    return n * elem_bytes


def group_tensors(shard: "ModelShard", group: list[LogicalTensor],
                  local: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """``group``'s whole tensors under Hugging Face names, on this rank's device.
    Collective over the replica's TP group at TP > 1 (every TP rank calls it), and over
    its EP group at EP > 1 (each expert from the rank holding it)."""
    from realign.runtime.engines.vllm_moe import expert_shard
    from realign.runtime.hf_checkpoint import gather_full, to_hf

    g = shard.groups
    out: list[tuple[str, torch.Tensor]] = []
    with torch.no_grad():
        for t in group:
            # an expert another EP rank holds comes from it (vllm_moe.expert_shard)
            mine = expert_shard(shard, t.name, local, t.shard_shape(g.layout.tp))
            full = gather_full(t, mine, g.pgs.tp, g.layout.tp) if g.layout.tp > 1 else mine
            out += list(to_hf(t, full, shard.spec).items())
    return out


class WeightTransport(Protocol):
    """Moves packed buckets from a replica's ranks into its vLLM engine. Every TP rank
    of the replica calls each method in the same order."""

    def begin(self) -> None:
        """Open a weight update (vLLM: layerwise reload begins)."""

    def send(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Deliver one bucket of whole Hugging Face tensors; returns once vLLM has
        loaded it (the bucket may be reused)."""

    def end(self) -> None:
        """Close the update (vLLM: the layers finalised)."""

    def close(self) -> None:
        """Release the transport's buffers."""


def push_weights(shard: "ModelShard", transport: WeightTransport,
                 bucket_bytes: int = BUCKET_BYTES) -> int:
    """Replace the engine's weights by the replica's, bucket by bucket; the bytes
    delivered (whole tensors)."""
    from realign.runtime.model import logical_shards

    groups = weight_groups(shard)
    elem = torch.empty((), dtype=next(shard.module.parameters()).dtype).element_size()
    sizes = [group_bytes(shard, grp, elem) for grp in groups]
    local = logical_shards(shard, shard.groups.layout, 0)
    transport.begin()
    for bucket in plan_buckets(sizes, bucket_bytes):
        tensors = [x for i in bucket for x in group_tensors(shard, groups[i], local)]
        transport.send(tensors)
        del tensors
    transport.end()
    return sum(sizes)


def push_hf(tensors: dict[str, torch.Tensor], transport: WeightTransport,
            bucket_bytes: int = BUCKET_BYTES) -> int:
    """Replace the engine's weights by ``tensors`` (Hugging Face names, whole tensors,
    one process: ``realign profile``'s probes), bucketed by layer as
    :func:`push_weights` does; the bytes delivered."""
    groups: dict[object, list[tuple[str, torch.Tensor]]] = {}
    for name, t in tensors.items():
        parts = name.split(".")
        layer = next((int(p) for p in parts if p.isdigit()), None)
        key = layer if layer is not None else ("pre" if not groups else "post")
        groups.setdefault(key, []).append((name, t))
    items = list(groups.values())
    sizes = [sum(t.numel() * t.element_size() for _, t in grp) for grp in items]
    transport.begin()
    for bucket in plan_buckets(sizes, bucket_bytes):
        transport.send([x for i in bucket for x in items[i]])
    transport.end()
    return sum(sizes)


# ---- CPU: POSIX shared memory ----------------------------------------------------------

#: the worker extension's methods the shared-memory transport calls
EXT_BEGIN, EXT_LOAD, EXT_END = "realign_begin_update", "realign_load_shm", "realign_end_update"


class SharedMemoryTransport:
    """CPU: one named shared-memory segment of ``capacity_bytes`` on the replica's TP
    rank 0, which hosts the engine; the engine's worker processes (one per TP rank)
    map it (:mod:`realign.runtime.engines.vllm_worker_ext`): the bucket is copied into
    the segment, out of it in each worker, and into vLLM's parameters. Extra memory:
    the segment and each worker's copy of one bucket, plus one bucket's gathered
    tensors at TP > 1.

    ``rpc`` is the engine's ``collective_rpc`` (every vLLM worker runs the method), None
    on a rank that does not host the engine (it only joins the gathers)."""

    def __init__(self, rpc: Callable | None, capacity_bytes: int):
        from multiprocessing import shared_memory

        self.rpc = rpc
        self.capacity_bytes = capacity_bytes
        self._shm = shared_memory.SharedMemory(create=True, size=max(1, capacity_bytes)) \
            if rpc is not None else None
        self._buffer = (torch.frombuffer(self._shm.buf, dtype=torch.uint8)
                        if self._shm is not None else None)

    @property
    def name(self) -> str | None:
        """The segment's name (``/dev/shm/<name>`` on Linux)."""
        return self._shm.name if self._shm is not None else None

    def begin(self) -> None:
        if self.rpc is not None:
            self.rpc(EXT_BEGIN)

    def send(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        if self.rpc is None:
            return
        assert self._buffer is not None
        entries = pack_into(self._buffer, [(n, t.cpu()) for n, t in tensors])
        self.rpc(EXT_LOAD, args=(self.name, [entry_to_wire(e) for e in entries]))

    def end(self) -> None:
        if self.rpc is not None:
            self.rpc(EXT_END)

    def close(self) -> None:
        if self._shm is not None:
            self._buffer = None
            self._shm.close()
            self._shm.unlink()
            self._shm = None


def entry_to_wire(e: Packed) -> list:
    """A :class:`Packed` as plain lists (what vLLM's RPC serialiser carries)."""
    return [e.name, e.dtype, list(e.shape), e.offset, e.nbytes]


def entry_from_wire(w: list) -> Packed:
    """The inverse of :func:`entry_to_wire`."""
    name, dtype, shape, offset, nbytes = w
    return Packed(str(name), str(dtype), tuple(int(s) for s in shape), int(offset), int(nbytes))


def iter_wire(entries: list[list]) -> Iterator[Packed]:
    """:func:`entry_from_wire` over a bucket's entries."""
    return (entry_from_wire(w) for w in entries)
