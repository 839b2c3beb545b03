"""Training-state offload (the plan's ``train_state_offload``): between its train calls
a trained model keeps only its weights on the device. Its gradient buffers are freed
(every step zeroes them first, so nothing is lost) and the optimizer state the device
holds (fp32 main weights and Adam's moments; under optimizer offload only the main
weights, the rest being on the host already) is copied to host memory and its device
storage freed. Before the next train call, or before a checkpoint reads or writes that
state, it comes back bit for bit.

Gradients: megatron-core's ``DistributedDataParallel.offload_grad_buffers`` /
``restore_grad_buffers`` (storage resized to zero and back, views stay valid).
Optimizer state: :mod:`realign.realloc.offload`, per storage, rather than megatron's
``MegatronOptimizer.offload_to_cpu``: that one rebinds ``p.data`` of CUDA tensors
only, which does nothing on the cpu device and, for main parameters that are views of
the model's own weights (fp32 training), would cut them off from the weights the
model computes with. Storages that back the model's weights are never offloaded."""
from __future__ import annotations

import torch

from realign.realloc import offload
from realign.runtime.optimizer_state import torch_optimizers


def optimizer_device_tensors(optimizer, module: torch.nn.Module,
                             device: torch.device) -> list[torch.Tensor]:
    """The optimizer's tensors on ``device`` (main parameters and per-parameter
    state) whose storage does not back one of ``module``'s weights."""
    weights = {p.untyped_storage().data_ptr() for p in module.parameters()}
    out = []
    for opt in torch_optimizers(optimizer):
        tensors = [p for g in opt.param_groups for p in g["params"]]
        tensors += [v for s in opt.state.values() for v in s.values()
                    if isinstance(v, torch.Tensor)]
        out += [t for t in tensors if t.device == device
                and t.untyped_storage().data_ptr() not in weights]
    return out


def own_state_storage(optimizer, device: torch.device) -> None:
    """Give each per-parameter state tensor on ``device`` whose storage cannot be
    resized (one ``torch.load`` made, a resumed run's Adam moments) a copy of its own,
    so parking can free it."""
    for opt in torch_optimizers(optimizer):
        for state in opt.state.values():
            for k, v in state.items():
                if (isinstance(v, torch.Tensor) and v.device == device
                        and not v.untyped_storage().resizable()):
                    state[k] = v.clone()


class StateParking:
    """Park a train engine's state off the device between calls (:meth:`park`) and
    bring it back (:meth:`unpark`); both are no-ops when already done."""

    def __init__(self, ddp_model, optimizer, module: torch.nn.Module, device: torch.device):
        self.ddp, self.optimizer, self.module, self.device = ddp_model, optimizer, module, device
        self._state: offload.Offloaded | None = None

    @property
    def parked(self) -> bool:
        return self._state is not None

    def park(self) -> None:
        """Free the gradients, move the optimizer's device state to the host."""
        if self._state is not None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)     # the step's kernels are done with them
        self.ddp.offload_grad_buffers(synchronize=False, empty_cache=False)
        own_state_storage(self.optimizer, self.device)
        self._state = offload.offload(
            optimizer_device_tensors(self.optimizer, self.module, self.device))

    def unpark(self) -> None:
        """The gradient buffers back (zeroed), the optimizer state back bit for bit."""
        if self._state is None:
            return
        offload.reload(self._state)
        self.ddp.restore_grad_buffers(synchronize=False)
        self._state = None
