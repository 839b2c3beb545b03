"""CUDA transports of a weight update into vLLM (vLLM 0.32's weight-transfer engines;
:mod:`realign.runtime.engines.vllm_weights` says what every transport shares).

* :class:`CudaIpcTransport`, when vLLM's workers sit on the replica's own GPUs (how
  realign places them): each TP rank of the replica packs the bucket's whole tensors
  into one reusable buffer on its GPU, exported once as a CUDA IPC handle; the handles
  are gathered over the replica's TP group (not the default group: vLLM's own IPC
  trainer engine gathers over the whole ``torch.distributed`` world, which in realign
  holds every worker of the run) and the hosting rank ships them, keyed by GPU UUID,
  pickled into one string (vLLM's RPC carries strings without its insecure-pickle
  switch, which hung its RPCs on CPU here), to realign's worker extension; each vLLM
  worker maps the buffer on its own GPU with vLLM's packed IPC consumer
  (``packed_ipc_consumer``, as its ``IPCWeightTransferEngine`` does) inside vLLM's
  layerwise reload. Device-to-device only. Extra memory
  per GPU: the buffer (the bucket's capacity), one bucket's gathered tensors, and vLLM's
  clone of the bucket while it loads it: about three buckets.
* :class:`NcclTransport`, when vLLM's workers are on other GPUs than the replica's
  (an engine built with ``nccl``, :func:`cuda_backend`): the hosting rank
  broadcasts each bucket to them over an NCCL group of its own (vLLM's
  ``NCCLTrainerWeightTransferEngine`` with two buffers of the bucket's capacity); the
  other TP ranks only join the gathers.

realign starts vLLM's workers on the replica's own GPUs, so its engines use IPC
(:func:`cuda_backend`). Neither has run here (no GPU with vLLM: docs/vllm.md); their
packing and bucketing are the shared, CPU-tested code.
"""
from __future__ import annotations

import base64
import pickle
from typing import TYPE_CHECKING, Any

import torch

from realign.runtime.engines.vllm_weights import (
    EXT_BEGIN,
    EXT_END,
    WeightTransport,
    bucket_capacity,
    group_bytes,
    pack_into,
    weight_groups,
)

if TYPE_CHECKING:
    from realign.runtime.model import ModelShard

#: the worker extension's method that loads a bucket from the CUDA IPC buffer
EXT_LOAD_IPC = "realign_load_ipc"


class CudaIpcTransport:
    """See the module docstring. ``llm`` is None on a rank that does not host the
    engine; ``tp_group``: the replica's TP group (None at TP 1)."""

    def __init__(self, llm: Any, capacity_bytes: int, tp_group: Any, tp: int):
        from torch.multiprocessing.reductions import reduce_tensor

        self.llm, self.tp_group, self.tp = llm, tp_group, tp
        self.buffer = torch.empty(capacity_bytes, dtype=torch.uint8, device="cuda")
        self.uuid = str(torch.cuda.get_device_properties(self.buffer.device.index).uuid)
        _, self._args = reduce_tensor(self.buffer)     # exported once, reused per bucket

    def _handles(self) -> dict[str, tuple]:
        """Every TP rank's buffer handle, keyed by its GPU's UUID."""
        mine = {self.uuid: self._args}
        if self.tp == 1:
            return mine
        import torch.distributed as dist

        gathered: list = [None] * self.tp
        dist.all_gather_object(gathered, mine, group=self.tp_group)
        return {k: v for h in gathered for k, v in h.items()}

    def begin(self) -> None:
        if self.llm is not None:
            self.llm.collective_rpc(EXT_BEGIN)

    def send(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        entries = pack_into(self.buffer, tensors)
        torch.cuda.current_stream().synchronize()       # the bucket is written
        handles = self._handles()
        if self.llm is not None:
            self.llm.collective_rpc(EXT_LOAD_IPC, args=(
                base64.b64encode(pickle.dumps(handles)).decode(), [e.name for e in entries],
                [e.dtype for e in entries], [list(e.shape) for e in entries],
                [e.nbytes for e in entries]))
        if self.tp > 1:                 # no rank overwrites its buffer before vLLM read it
            import torch.distributed as dist

            dist.barrier(group=self.tp_group)

    def end(self) -> None:
        if self.llm is not None:
            self.llm.collective_rpc(EXT_END)
        torch.cuda.ipc_collect()

    def close(self) -> None:
        del self.buffer
        torch.cuda.ipc_collect()


class _RpcClient:
    """vLLM's ``VLLMWeightSyncClient`` over ``LLM.collective_rpc``."""

    def __init__(self, llm: Any):
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.llm.collective_rpc("init_weight_transfer_engine", args=(init_info,))

    def start_weight_update(self) -> None:
        self.llm.collective_rpc("start_weight_update")

    def update_weights(self, update_info: Any) -> None:
        self.llm.collective_rpc("update_weights", args=(update_info,))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.collective_rpc("finish_weight_update")


class NcclTransport:
    """See the module docstring. vLLM's NCCL trainer engine sends a whole update in
    one round (its metadata first, then the packed broadcasts), so this transport
    collects the buckets' tensors as :meth:`send` sees them, one bucket at a time, and
    broadcasts each bucket as a round of its own (``start``/``update``/``finish`` per
    bucket would finalise the layers early, so one layerwise reload spans them: the
    bucket's round is an ``update_weights`` under one ``start_weight_update``)."""

    def __init__(self, llm: Any, capacity_bytes: int, n_workers: int, port: int):
        self.llm = llm
        self._engine = None
        if llm is None:
            return
        from concurrent.futures import ThreadPoolExecutor

        from vllm.distributed.weight_transfer.nccl_common import (
            NCCLWeightTransferInitInfo,
            worker_init_payload,
        )
        from vllm.distributed.weight_transfer.nccl_common import trainer_init as open_endpoint

        info = NCCLWeightTransferInitInfo(
            master_address="127.0.0.1", master_port=port, rank_offset=1,
            world_size=1 + n_workers, packed=True, packed_buffer_size_bytes=capacity_bytes,
            packed_num_buffers=2)
        self.capacity_bytes = capacity_bytes
        with ThreadPoolExecutor(max_workers=1) as exe:
            future = exe.submit(self.llm.collective_rpc, "init_weight_transfer_engine",
                                args=(worker_init_payload(info),))
            self.group = open_endpoint(info)
            future.result()

    def begin(self) -> None:
        if self.llm is not None:
            self.llm.collective_rpc("start_weight_update")

    def send(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        if self.llm is None:
            return
        from concurrent.futures import ThreadPoolExecutor

        from vllm.distributed.weight_transfer.packed_tensor import (
            packed_nccl_broadcast_producer,
        )

        info = {"names": [n for n, _ in tensors],
                "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in tensors],
                "shapes": [list(t.shape) for _, t in tensors]}
        exe = ThreadPoolExecutor(max_workers=1)
        try:
            future = exe.submit(self.llm.collective_rpc, "update_weights", args=(info,))
            packed_nccl_broadcast_producer(
                iterator=iter(tensors), group=self.group, src=0,
                post_iter_func=lambda item: item[1], buffer_size_bytes=self.capacity_bytes,
                num_buffers=2)
            future.result()
        finally:
            exe.shutdown(wait=False)
        torch.cuda.current_stream().synchronize()

    def end(self) -> None:
        if self.llm is not None:
            self.llm.collective_rpc("finish_weight_update")

    def close(self) -> None:
        if self.llm is not None:
            self.group.destroy()


def free_port() -> int:
    """A TCP port free on this host now (the NCCL group's rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cuda_backend(replica_devices: list[int], engine_devices: list[int]) -> str:
    """vLLM's weight-transfer backend for an engine whose workers use
    ``engine_devices`` (local GPU indices) fed by a replica on ``replica_devices``:
    ``ipc`` where every worker's GPU holds a rank of the replica, else ``nccl``.

    Example: replica on GPUs 2, 3, engine on 2, 3 -> ``ipc``; engine on 6, 7 -> ``nccl``."""
    return "ipc" if set(engine_devices) <= set(replica_devices) else "nccl"


def cuda_transport(llm: Any, shard: "ModelShard | None", bucket_bytes: int,
                   backend: str) -> WeightTransport:
    """The transport of ``backend`` (:func:`cuda_backend`, fixed when the engine was
    built). IPC is checked against the GPUs' UUIDs: a vLLM worker on a GPU no rank of
    the replica holds is an error. A collective over the replica's TP group."""
    import torch.distributed as dist

    if shard is None:                   # one process (profile probes): IPC to itself
        return CudaIpcTransport(llm, bucket_bytes, None, 1)
    g = shard.groups
    elem = next(shard.module.parameters()).element_size()
    cap = bucket_capacity([group_bytes(shard, grp, elem) for grp in weight_groups(shard)],
                          bucket_bytes)
    if backend == "nccl":
        port: list = [free_port() if llm is not None else None]
        n_workers = [g.layout.tp]
        if g.layout.tp > 1:
            dist.broadcast_object_list(port, src=g.world_rank(0, g.dp_rank, g.pp_rank),
                                       group=g.pgs.tp)
        return NcclTransport(llm, cap, n_workers[0], int(port[0] or 0))
    mine = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
    ours: list = [mine]
    if g.layout.tp > 1:
        ours = [None] * g.layout.tp
        dist.all_gather_object(ours, mine, group=g.pgs.tp)
    if llm is not None:
        theirs = llm.collective_rpc("realign_device_uuid")
        if not set(theirs) <= set(ours):
            raise RuntimeError(f"vLLM's workers on GPUs {theirs} are not the replica's "
                               f"{ours}: CUDA IPC cannot reach them")
    return CudaIpcTransport(llm, cap, g.pgs.tp, g.layout.tp)
