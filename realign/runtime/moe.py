"""A mixture of experts' MLP (Qwen3-MoE) on one TP rank: the module that holds a sparse
layer's parameters inside megatron's ``TransformerLayer`` (in place of its MLP), and the
forward both realign's decoder (:mod:`realign.runtime.engines.decoder`) and megatron's
layer run.

Parameters, under the planner's logical names (:func:`planner.specs.param_layout.expert_tensors`):
``mlp.router.weight`` [experts, hidden], whole on every TP rank, and per expert
``mlp.experts.local_experts.<e>.linear_fc1.weight`` ([gate; up] rows of this rank, as
the dense MLP's fc1) and ``linear_fc2.weight`` (this rank's columns).

The forward is transformers' ``Qwen3MoeSparseMoeBlock``: router logits, softmax over the
experts in fp32, the top-k, renormalised to sum to 1 when ``norm_topk_prob``; each
expert hit runs its SwiGLU on its tokens and adds its output, scaled by the routing
weight. Every TP rank routes alike (same input, same router); the experts' partial
outputs (row-parallel fc2) are summed over TP once, after the weighted sum (linear).
For the backward, the routing weights enter the TP-split computation through the same
copy as a column-parallel layer's input, so the router's gradient is summed over TP and
equal on every rank.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from planner.specs.model_spec import ModelSpec
from planner.specs.param_layout import expert_tensors

#: ``t -> t`` with a TP collective in forward or backward (identity at TP 1)
Mapping = Callable[[torch.Tensor], torch.Tensor]


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


class _Weight(torch.nn.Module):
    """A module holding one ``weight`` (so the parameter names are megatron's)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(shape, dtype=dtype, device=device))


class _Expert(torch.nn.Module):
    def __init__(self, fc1: tuple[int, ...], fc2: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device):
        super().__init__()
        self.linear_fc1 = _Weight(fc1, dtype, device)
        self.linear_fc2 = _Weight(fc2, dtype, device)


class _Experts(torch.nn.Module):
    def __init__(self, experts: list[_Expert]):
        super().__init__()
        self.local_experts = torch.nn.ModuleList(experts)


class MoeMLP(torch.nn.Module):
    """Sparse layer ``layer``'s router and experts, this TP rank's shards.

    ``init_seed``: random weights (normal, ``std``), each full tensor drawn from its own
    generator seeded by (seed, layer, tensor) and then sliced, so every TP layout of a
    seed holds the same model; None: zeros (weights come from a checkpoint).
    ``tp_group``: the replica's TP group (None at TP 1)."""

    def __init__(self, spec: ModelSpec, layer: int, tp: int, tp_rank: int, tp_group,
                 dtype: torch.dtype, device: torch.device, init_seed: int | None = None,
                 std: float = 0.02):
        super().__init__()
        assert spec.moe is not None and spec.is_sparse(layer)
        self.top_k, self.norm_topk_prob = spec.moe.top_k, spec.moe.norm_topk_prob
        self.tp_group = tp_group
        tensors = expert_tensors(spec, layer)
        router, fc = tensors[0], tensors[1:]
        self.router = _Weight(router.shape, dtype, device)
        self.experts = _Experts([_Expert(fc[2 * e].shard_shape(tp), fc[2 * e + 1].shard_shape(tp),
                                         dtype, device) for e in range(spec.moe.n_experts)])
        if init_seed is None:
            return
        params = [self.router.weight] + [p for ex in self.experts.local_experts
                                         for p in (ex.linear_fc1.weight, ex.linear_fc2.weight)]
        with torch.no_grad():
            for i, (t, p) in enumerate(zip(tensors, params)):
                g = torch.Generator().manual_seed(init_seed * 1_000_003 + layer * 10_007 + i)
                full = torch.randn(t.shape, generator=g) * std
                if t.shard_dim is not None:
                    full = torch.cat([full.narrow(t.shard_dim, a, b - a)
                                      for a, b in t.shard_ranges(tp_rank, tp)], t.shard_dim)
                p.copy_(full.to(dtype))

    def fc1s(self) -> list[torch.Tensor]:
        return [ex.linear_fc1.weight for ex in self.experts.local_experts]

    def fc2s(self) -> list[torch.Tensor]:
        return [ex.linear_fc2.weight for ex in self.experts.local_experts]

    def mlp(self, y: torch.Tensor, copy: Mapping = _same, reduce: Mapping = _same
            ) -> torch.Tensor:
        """The layer's MLP output for its normed input ``y`` [..., h] (``copy``,
        ``reduce``: the TP mappings of a column- and a row-parallel layer)."""
        return moe_forward(y, self.router.weight, self.fc1s(), self.fc2s(), self.top_k,
                           self.norm_topk_prob, copy, reduce)

    def forward(self, hidden: torch.Tensor, padding_mask=None):
        """Megatron's MLP call: ``[s, b, h] -> ([s, b, h], None)``."""
        copy, reduce = tp_mappings(self.tp_group)
        return self.mlp(hidden, copy, reduce), None


def route(y: torch.Tensor, router: torch.Tensor, top_k: int, norm_topk_prob: bool
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in ``y``'s dtype, experts [T, k]) of tokens ``y`` [T, h]: softmax
    over all experts in fp32, the top-k, renormalised when ``norm_topk_prob``."""
    probs = torch.softmax(F.linear(y, router), dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(y.dtype), experts


def moe_forward(y: torch.Tensor, router: torch.Tensor, fc1s: list[torch.Tensor],
                fc2s: list[torch.Tensor], top_k: int, norm_topk_prob: bool,
                copy: Mapping = _same, reduce: Mapping = _same) -> torch.Tensor:
    """Routed experts' output for ``y`` [..., h] (the module docstring)."""
    shape = y.shape
    flat = y.reshape(-1, shape[-1])
    weights, experts = route(flat, router, top_k, norm_topk_prob)
    weights = copy(weights)          # used by TP-split experts: gradient summed over TP
    x = copy(flat)
    out = torch.zeros(flat.shape[0], fc2s[0].shape[0] if fc2s else shape[-1], dtype=y.dtype,
                      device=y.device)
    for e in torch.unique(experts).tolist():
        token, slot = torch.where(experts == e)
        gate, up = F.linear(x[token], fc1s[e]).chunk(2, dim=-1)
        h = F.linear(F.silu(gate) * up, fc2s[e])
        out = out.index_add(0, token, h * weights[token, slot, None])
    return reduce(out).reshape(shape)


def tp_mappings(tp_group) -> tuple[Mapping, Mapping]:
    """(copy, reduce) of a column- and a row-parallel layer over ``tp_group`` (identity
    at TP 1; without autograd a plain all-reduce)."""
    if tp_group is None or torch.distributed.get_world_size(tp_group) == 1:
        return _same, _same

    def copy(t: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return t
        from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
        return copy_to_tensor_model_parallel_region(t, tp_group)

    def reduce(t: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            torch.distributed.all_reduce(t, group=tp_group)
            return t
        from megatron.core.tensor_parallel.mappings import (
            reduce_from_tensor_model_parallel_region,
        )
        return reduce_from_tensor_model_parallel_region(t, tp_group)
    return copy, reduce
