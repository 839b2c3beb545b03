"""A LoRA actor on vLLM: vLLM's own LoRA (``enable_lora``, a ``LoRARequest`` per
generate call) with the adapters handed over in memory each call, the base never.

* **The base** is the role's checkpoint, which vLLM loads when the engine starts: a LoRA
  actor's base is frozen, so it is never sent again (the engine's weight transport is
  not even made).
* **The adapters** (PEFT's layout, :func:`realign.runtime.lora_peft.full_adapters`:
  gathered over the replica's TP group, every projection its own ``A`` and ``B``) go to
  vLLM's workers in memory: packed into one POSIX shared-memory segment on the replica's
  TP rank 0, mapped by each vLLM worker
  (:meth:`~realign.runtime.engines.vllm_worker_ext.RealignWorkerExtension.realign_add_lora`),
  which builds vLLM's ``LoRAModel`` from the tensors (``LoRAModel.from_lora_tensors``,
  what vLLM's own folder loader calls after reading the safetensors file) and registers
  it under a new id in its LoRA manager, replacing the previous policy's. vLLM's
  ``LoRARequest`` carries no tensors and its worker's ``add_lora`` takes a folder only;
  once an id is registered, a request naming it loads nothing (vLLM's LRU manager only
  touches it), so the path such a request names is never read.
* **A new id per policy version**: each :meth:`VLLMAdapters.push` takes the next id
  (vLLM ids start at 1), so no request can reach the previous policy's adapter.

The same route serves CUDA: vLLM's LoRA manager loads an adapter on the host and copies
it into its GPU slots itself, so the adapters pass through host memory there too
(device to host, host to device: the planner prices both, :mod:`planner.cost.vllm_cost`).
"""
from __future__ import annotations

from collections.abc import Callable
from multiprocessing import shared_memory

import torch

from planner.cost.vllm_cost import VLLM_LORA_RANKS
from realign.runtime.engines.vllm_weights import entry_to_wire, pack_into

#: the worker extension's method that registers an adapter from shared memory
EXT_ADD_LORA = "realign_add_lora"
#: the path a request of a registered adapter names (never read: see the module docstring)
MEMORY_PATH = "realign-memory"


def max_lora_rank(rank: int) -> int:
    """vLLM's ``max_lora_rank`` for adapters of rank ``rank``: the least rank vLLM
    accepts that is at least ``rank``. Raises past vLLM's largest.

    Example: 4 -> 8; 64 -> 64; 100 -> 128."""
    for r in VLLM_LORA_RANKS:
        if r >= rank:
            return r
    raise ValueError(f"vLLM takes LoRA ranks up to {VLLM_LORA_RANKS[-1]}, not {rank}")


def lora_engine_args(lora) -> dict:
    """vLLM ``LLM`` arguments of an engine generating with ``lora``'s adapters (a
    :class:`~planner.specs.lora.LoraSpec`; None: no LoRA): one adapter at a time."""
    if lora is None:
        return {}
    return dict(enable_lora=True, max_lora_rank=max_lora_rank(lora.rank), max_loras=1,
                max_cpu_loras=1)


def lora_request(lora_id: int):
    """vLLM's request of the adapter registered under ``lora_id``."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=f"realign-{lora_id}", lora_int_id=lora_id,
                       lora_path=MEMORY_PATH)


class VLLMAdapters:
    """The adapters of one vLLM engine's replica: :meth:`push` hands the replica's
    current adapters to the engine under a new id. ``rpc``: the engine's
    ``collective_rpc`` (None on a TP rank that hosts no engine: it only joins the
    gather); ``config``: the adapter's PEFT ``adapter_config.json`` as a dict."""

    def __init__(self, rpc: Callable | None, config: dict):
        self.rpc, self.config = rpc, config
        #: the id of the adapter the engine holds (0: none yet)
        self.lora_id = 0
        self._shm: shared_memory.SharedMemory | None = None

    def push(self, shard) -> int:
        """Hand ``shard``'s adapters (PP 1) to the engine under the next id; the bytes
        delivered. Every TP rank of the replica calls it (a gather over TP)."""
        from realign.runtime.lora_peft import full_adapters

        tensors = full_adapters(shard)      # collective over the replica's TP group
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        self.lora_id += 1
        if self.rpc is None:
            return nbytes
        buffer = self._buffer(nbytes)
        entries = pack_into(buffer, list(tensors.items()))
        assert self._shm is not None
        self.rpc(EXT_ADD_LORA, args=(self._shm.name, [entry_to_wire(e) for e in entries],
                                     self.lora_id, self.config))
        return nbytes

    def _buffer(self, nbytes: int) -> torch.Tensor:
        """The segment as a byte tensor, made (again) when ``nbytes`` outgrow it."""
        if self._shm is None or self._shm.size < nbytes:
            self.close()
            self._shm = shared_memory.SharedMemory(create=True, size=max(1, nbytes))
        return torch.frombuffer(self._shm.buf, dtype=torch.uint8)

    def request(self):
        """vLLM's request of the adapter pushed last."""
        assert self.lora_id > 0, "no adapter was pushed to the engine"
        return lora_request(self.lora_id)

    def close(self) -> None:
        if self._shm is not None:
            self._shm.close()
            self._shm.unlink()
            self._shm = None
