"""Offload in the cost model: which settings of optimizer offload and training-state
offload the search prices for a call (:func:`offload_options`,
:func:`state_offload_options`), and the seconds each adds (:func:`offload_step_s` per
optimizer step, :func:`state_transfer_s` per train call); the bytes they free:
:mod:`planner.cost.memory`."""
from __future__ import annotations

from typing import TYPE_CHECKING

from planner.cost.cost_config import CostModelConfig
from planner.errors import PlanError
from planner.graph.dataflow import MFC
from planner.specs.cluster import DeviceSpec

if TYPE_CHECKING:
    from planner.cost.rates import Rates


def offload_options(config: CostModelConfig, device: DeviceSpec, mfc: MFC) -> tuple[bool, ...]:
    """The optimizer-offload settings to price for ``mfc``: only training has
    optimizer state; the device must offer it (``host_adam_params_per_s``) and the
    distributed optimizer must shard it (megatron offloads only that); realign's own
    trainer only (``train_engine``: another system's is priced as its run was, on the
    GPU)."""
    mode = config.optimizer_offload
    if (mfc.kind != "train" or mode == "never" or not config.distributed_optimizer
            or config.train_engine != "own"
            or device.host_adam_params_per_s is None):
        return (False,)
    return (True,) if mode == "always" else (False, True)


def state_offload_options(config: CostModelConfig, device: DeviceSpec,
                          mfc: MFC) -> tuple[bool, ...]:
    """The training-state-offload settings to price for ``mfc`` (train only):
    'auto' offers it where the device has memory of its own beside the host's (it
    offers optimizer offload: ``host_adam_params_per_s``); 'always' everywhere (the
    runtime executes it on any device; on the cpu device the "host" is the same
    memory, so it frees nothing there); realign's own trainer only."""
    mode = config.train_state_offload
    if mfc.kind != "train" or mode == "never" or config.train_engine != "own":
        return (False,)
    if mode == "always":
        return (True,)
    return (False,) if device.host_adam_params_per_s is None else (False, True)


def state_transfer_s(rates: Rates, kept_bytes: float) -> float:
    """Seconds one train call with training-state offload adds: the optimizer
    state the GPU keeps during the call (``kept_bytes`` per GPU: the fp32 main
    weights and Adam's moments, or only the main weights under optimizer offload)
    comes up from host memory before the call and goes down after it over the host
    link (``host_link_bytes_per_s``: the profile's, else the device preset's); the
    gradients are freed, not moved.

    Example: 1.2e10 bytes at 25 GB/s: 2 x 0.48 = 0.96 s."""
    return 2 * kept_bytes / rates.host_link_bytes_per_s


def offload_step_s(config: CostModelConfig, device: DeviceSpec, rates: Rates,
                   shard_params: float) -> float:
    """Seconds one optimizer step with offloaded state adds for a GPU whose
    optimizer shard holds ``shard_params`` parameters: its fp32 gradients down and
    its fp32 main weights back up over the host link (``host_link_bytes_per_s``),
    and the host's Adam step (``host_adam_params_per_s``); nothing overlaps.

    Example: 1e9 parameters, 25 GB/s, 5e8 params/s: 8e9 / 25e9 + 2 = 2.32 s.
    """
    adam = device.host_adam_params_per_s
    if adam is None:
        raise PlanError(f"{device.name} has no host Adam rate "
                        "(host_adam_params_per_s), so optimizer offload cannot be "
                        "priced on it", field="plan.cost.optimizer_offload")
    moved = (config.grad_dtype_bytes + 4) * shard_params
    return moved / rates.host_link_bytes_per_s + shard_params / adam
