"""The router's load-balancing loss of a mixture of experts split over pipeline stages.

Each stage pools its own sparse layers' routing (:func:`realign.runtime.moe.load_balancing_loss`)
and weights the result by its share of the model's sparse layers; the loss is the sum over
stages. At PP1 this is transformers' loss pooled over every layer; at PP > 1 each stage's
``f_e`` and ``P_e`` are pooled over its own layers only (uniform routing gives ``top_k``
either way). A stage without sparse layers adds nothing.

A stage other than the last has no loss of its own in megatron's schedule: its term is
attached to the activation it sends on (:func:`attach_loss`, as megatron's
``MoEAuxLossAutoScaler``), so the backward through that activation also seeds the term's
gradient; its logged value is summed into the last stage's metrics
(:func:`sum_stage_metric`)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from planner.specs.model_spec import ModelSpec


def stage_aux_weight(spec: ModelSpec, pp: int, pp_rank: int) -> float:
    """Stage ``pp_rank``'s share of the sparse layers (0 when it holds none). Example:
    4 layers, layers 2 and 3 dense, PP2: stage 0 weighs 1, stage 1 weighs 0."""
    per = spec.n_layers // pp
    mine = sum(spec.is_sparse(x) for x in range(pp_rank * per, (pp_rank + 1) * per))
    return mine / max(1, spec.sparse_layers())


class _AttachLoss(torch.autograd.Function):
    """Identity on ``out``; its backward also gives ``loss`` the gradient 1."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(loss)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (loss,) = ctx.saved_tensors
        return grad, torch.ones_like(loss)


def attach_loss(out: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    """``out`` unchanged, whose backward also back-propagates ``loss`` (a scalar)."""
    return _AttachLoss.apply(out, loss)


def sum_stage_metric(reduced: list[dict], key: str, mine: list[torch.Tensor],
                     n_micro: int, group, device: torch.device) -> None:
    """Add every other stage's per-micro-batch values of ``key`` (``mine``: this stage's,
    empty on the last stage and on a stage without sparse layers) into the last stage's
    ``reduced`` (its schedule's per-micro-batch metrics; empty elsewhere), in place; call
    on every stage of the replica."""
    vals = torch.zeros(n_micro, device=device)
    for i, v in enumerate(mine):
        vals[i] = v.detach().to(device)
    dist.all_reduce(vals, group=group)
    for i, r in enumerate(reduced):
        r[key] = r[key].detach().to(device) + vals[i]
