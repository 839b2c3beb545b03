"""realign's methods on vLLM's worker processes (``worker_extension_cls``): a weight
update from a POSIX shared-memory bucket
(:class:`~realign.runtime.engines.vllm_weights.SharedMemoryTransport`) or from a
packed GPU buffer shared by CUDA IPC
(:class:`~realign.runtime.engines.vllm_cuda_weights.CudaIpcTransport`).

vLLM mixes this class into its worker; each method runs on every worker of the engine
(one per TP rank) through ``LLM.collective_rpc``. The update follows vLLM's own weight
transfer engines: layerwise reload begins, each bucket's tensors go to the model's
``load_weights`` (checkpoint names, whole tensors: each TP rank keeps its slice), the
layers are finalised. The bucket is mapped and its tensors copied out of it before
they go to the loader: vLLM keeps references to what it is handed until it processes a
layer (some layers only when the update is finalised), and the next bucket overwrites
the segment (vLLM's own packed IPC consumer copies for the same reason).
"""
from __future__ import annotations

from realign.runtime.engines.vllm_routing import RoutingCaptureExtension


class RealignWorkerExtension(RoutingCaptureExtension):
    """Mixed into vLLM's worker (``self`` is the worker); the MoE routing record's
    methods come from :class:`~realign.runtime.engines.vllm_routing.RoutingCaptureExtension`."""

    def realign_begin_update(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        with set_current_vllm_config(self.vllm_config):            # type: ignore[attr-defined]
            initialize_layerwise_reload(self.model_runner.get_model())  # type: ignore[attr-defined]

    def realign_load_shm(self, name: str, entries: list[list]) -> int:
        """Load one bucket from the shared-memory segment ``name``; its bytes."""
        from multiprocessing import resource_tracker, shared_memory

        import torch
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.mtp_validation import (
            disable_mtp_completeness_check,
        )

        from realign.runtime.engines.vllm_weights import iter_wire, unpack

        shm = shared_memory.SharedMemory(name=name)
        # mapped, not owned: the realign worker unlinks it (Python 3.11 registers every
        # attach with the resource tracker, which would unlink it when this process ends)
        resource_tracker.unregister(shm._name, "shared_memory")     # type: ignore[attr-defined]
        try:
            buffer = torch.frombuffer(shm.buf, dtype=torch.uint8)
            packed = list(iter_wire(entries))
            # copied out: vLLM keeps what it is handed until it processes a layer, some
            # only when the update ends, and the next bucket overwrites the segment
            weights = [(n, t.clone()) for n, t in unpack(buffer, packed)]
            with (set_current_vllm_config(self.vllm_config),       # type: ignore[attr-defined]
                  disable_mtp_completeness_check()):
                self.model_runner.get_model().load_weights(weights)  # type: ignore[attr-defined]
            del weights, buffer
            return sum(e.nbytes for e in packed)
        finally:
            shm.close()

    def realign_load_ipc(self, handles_b64: str, names: list[str], dtype_names: list[str],
                         shapes: list[list[int]], sizes: list[int]) -> int:
        """CUDA: load one bucket from the replica's packed GPU buffer (its CUDA IPC
        handles by GPU UUID, pickled and base64-encoded, so vLLM's RPC carries a string);
        vLLM's own packed IPC consumer maps it on this worker's GPU and clones the
        bucket's tensors; its bytes."""
        import base64
        import pickle

        from vllm.config import set_current_vllm_config
        from vllm.distributed.weight_transfer.packed_tensor import (
            PackedBufferImporter,
            packed_ipc_consumer,
        )
        from vllm.model_executor.model_loader.mtp_validation import (
            disable_mtp_completeness_check,
        )

        if not hasattr(self, "_realign_importer"):
            self._realign_importer = PackedBufferImporter()
        weights = packed_ipc_consumer(
            ipc_handle=pickle.loads(base64.b64decode(handles_b64)), names=names,
            shapes=shapes, dtype_names=dtype_names, tensor_sizes=sizes,
            device_index=self.device.index,                         # type: ignore[attr-defined]
            importer=self._realign_importer)
        with (set_current_vllm_config(self.vllm_config),           # type: ignore[attr-defined]
              disable_mtp_completeness_check()):
            self.model_runner.get_model().load_weights(weights)      # type: ignore[attr-defined]
        return sum(sizes)

    def realign_end_update(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        model = self.model_runner.get_model()                       # type: ignore[attr-defined]
        with set_current_vllm_config(self.vllm_config):              # type: ignore[attr-defined]
            finalize_layerwise_reload(model, self.vllm_config.model_config)  # type: ignore[attr-defined]
        self.realign_repack_experts()
        importer = getattr(self, "_realign_importer", None)
        if importer is not None:        # the replica may reclaim its IPC buffer
            importer.close()

    def realign_repack_experts(self) -> int:
        """Put a mixture of experts' updated weights back into the layout vLLM's CPU
        kernel reads (:mod:`realign.runtime.engines.vllm_moe`); the layers repacked."""
        from realign.runtime.engines.vllm_moe import repack_cpu_experts

        return repack_cpu_experts(self.model_runner.get_model())    # type: ignore[attr-defined]

    def realign_add_lora(self, name: str, entries: list[list], lora_id: int,
                         config: dict) -> int:
        """Register the adapter in the shared-memory segment ``name`` (PEFT's tensors,
        whole: vLLM slices them for this worker's TP rank) under ``lora_id`` in vLLM's
        LoRA manager, in place of every adapter it held, and activate it; its bytes.
        :mod:`realign.runtime.engines.vllm_lora` says why this is not ``add_lora``."""
        from multiprocessing import resource_tracker, shared_memory

        import torch
        from vllm.lora.peft_helper import PEFTHelper
        from vllm.utils.gpu_sync_debug import gpu_sync_allowed

        from realign.runtime.engines.vllm_weights import iter_wire, unpack

        shm = shared_memory.SharedMemory(name=name)
        resource_tracker.unregister(shm._name, "shared_memory")     # type: ignore[attr-defined]
        try:
            buffer = torch.frombuffer(shm.buf, dtype=torch.uint8)
            packed = list(iter_wire(entries))
            tensors = {n: t.clone() for n, t in unpack(buffer, packed)}
            del buffer
        finally:
            shm.close()
        manager = self.model_runner.lora_manager                   # type: ignore[attr-defined]
        peft = PEFTHelper.from_dict(dict(config))
        peft.validate_legal(manager.lora_config)
        models = manager._adapter_manager        # vLLM's LoRAModelManager of this worker
        model = models.model
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        lora = manager._lora_model_cls.from_lora_tensors(
            lora_model_id=lora_id, tensors=tensors, peft_helper=peft, device="cpu",
            dtype=manager.lora_config.lora_dtype, model_vocab_size=manager.vocab_size,
            weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
            skip_prefixes=getattr(model, "lora_skip_prefixes", None))
        with gpu_sync_allowed():        # as vLLM's own add_adapter
            for old in manager.list_adapters():
                manager.remove_adapter(old)
            models.add_adapter(lora)
            models.activate_adapter(lora_id)
        return sum(e.nbytes for e in packed)

    def realign_lora_ids(self) -> list[int]:
        """The adapter ids this worker's LoRA manager holds."""
        return sorted(self.model_runner.lora_manager.list_adapters())  # type: ignore[attr-defined]

    def realign_device_uuid(self) -> str:
        """This worker's GPU (its UUID), or ``cpu``: which transport reaches it."""
        import torch

        if torch.cuda.is_available():
            return str(torch.cuda.get_device_properties(self.device.index).uuid)  # type: ignore[attr-defined]
        return "cpu"
