"""An optimizer's whole state for a checkpoint: the torch optimizers' state (Adam's
moments, step counts) *and the main parameters they update*.

With bf16 parameters megatron's mixed-precision optimizers (``Float16Optimizer``,
``DistributedOptimizer``) step on fp32 main copies that they clone from the model when
they are built. A checkpoint of the model's bf16 weights and the torch state alone
would bring back neither: the resumed run would start from the bf16-rounded weights
(or, worse, from the initial weights its optimizer cloned). So the main parameters'
values are saved too and copied back after the torch state is loaded; with fp32
parameters the main parameters are the model's own (or views of them) and the copy
restores what the model load already did. Per rank: a checkpoint only resumes the
same plan and sharding (the run checks this before any worker starts).
"""
from __future__ import annotations

import torch


def torch_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside a megatron optimizer (one per chained optimizer)."""
    return [sub.optimizer for sub in getattr(optimizer, "chained_optimizers", [optimizer])]


def _main_params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in opt.param_groups for p in group["params"]]


def optimizer_state(optimizer) -> dict:
    """What :func:`load_optimizer_state` needs to continue exactly where this is."""
    opts = torch_optimizers(optimizer)
    return {"torch": [o.state_dict() for o in opts],
            "main_params": [[p.detach().clone() for p in _main_params(o)] for o in opts]}


def load_optimizer_state(optimizer, state: dict) -> None:
    """Restore :func:`optimizer_state` (after the model's weights are loaded). Raises
    ``ValueError`` (torch's, for parameter groups of other sizes) when the state is of
    another sharding; a checkpoint of an older realign holds one torch state and no
    main parameters."""
    opts = torch_optimizers(optimizer)
    if "torch" not in state:
        opts[0].load_state_dict(state)
        return
    if len(state["torch"]) != len(opts):
        raise ValueError(f"the checkpoint holds {len(state['torch'])} optimizers, this "
                         f"replica has {len(opts)}")
    for opt, saved, mains in zip(opts, state["torch"], state["main_params"]):
        opt.load_state_dict(saved)
        params = _main_params(opt)
        if len(params) != len(mains):
            raise ValueError(f"the checkpoint holds {len(mains)} main parameters, this "
                             f"optimizer has {len(params)}")
        for p, value in zip(params, mains):
            if p.shape != value.shape:
                raise ValueError(f"a main parameter of shape {tuple(value.shape)} for one "
                                 f"of shape {tuple(p.shape)}")
            with torch.no_grad():
                p.copy_(value)
