"""A replica's megatron optimizer, built and stepped: the replica's ranks only while it
is built (:func:`world_is_replica`), torch's fused Adam kernel where megatron has no
switch for it (:func:`use_fused_adam`), and a step that checks the gradient norm
before the update (:func:`checked_step`)."""
from __future__ import annotations

import contextlib
import math
from typing import Iterator

import torch
import torch.distributed as dist

from realign.errors import NonFiniteError


def checked_step(optimizer) -> tuple[bool, float]:
    """megatron's optimizer step (``MegatronOptimizer.step``, ``ChainedOptimizer.step``)
    with the gradient norm checked before the update: ``prepare_grads`` (an fp16
    overflow skips the step, as megatron does), the global gradient norm (reduced over
    the replica, so every rank sees the same value), clipping to each optimizer's
    ``clip_grad`` (0: none), then the update. A norm that is not finite raises
    :class:`NonFiniteError` on every rank alike, and the parameters keep their values.
    Returns (updated, gradient norm)."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    if optimizer.prepare_grads():
        return False, float("nan")
    grad_norm = float(optimizer.get_grad_norm())
    if not math.isfinite(grad_norm):
        raise NonFiniteError(f"the gradient norm is {grad_norm}; the update was not applied",
                             field="train")
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        params = sub.get_parameters()
        if params and sub.config.clip_grad > 0:
            clip_grad_by_total_norm_fp32(
                params, sub.config.clip_grad, grad_norm,
                sub.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
    return bool(optimizer.step_with_ready_grads()), grad_norm


def use_fused_adam(optimizer) -> bool:
    """Switch torch's Adam/AdamW to its fused kernel (one call for every parameter)
    before its first step; returns whether it did.

    Without TE or apex, megatron builds torch's ``AdamW`` with the default
    per-tensor loop, and has no setting for torch's ``fused`` flag. On CPU the fused
    kernel is ~3x faster for a small model, whose step is dominated by per-operation
    overhead (benchmarks/step/README.md). Only torch's own
    classes are switched (TE's and apex's are fused already), and only while no state
    exists: the flag decides the dtype and device of the step counters torch creates."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW) or optimizer.state:
        return False
    for group in optimizer.param_groups:
        group["foreach"], group["fused"] = False, True
    return True


@contextlib.contextmanager
def world_is_replica(replica_group) -> Iterator[None]:
    """While megatron builds the optimizer, make its group-less ``all_gather_object``
    (aligning parameter groups "across all ranks") span the replica, not the world:
    a replica's optimizer is built by the replica's ranks only."""
    gather, size = dist.all_gather_object, dist.get_world_size

    def all_gather_object(object_list, obj, group=None, **kw):
        return gather(object_list, obj, group=group if group is not None else replica_group, **kw)

    def get_world_size(group=None):
        return size(group if group is not None else replica_group)

    dist.all_gather_object, dist.get_world_size = all_gather_object, get_world_size
    try:
        yield
    finally:
        dist.all_gather_object, dist.get_world_size = gather, size
