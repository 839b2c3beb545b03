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
chosen expert's SwiGLU output is added, scaled by the routing weight
(:mod:`realign.runtime.moe_experts`: at decode shapes every expert on every token in one
batched matmul, without reading the routing on the host; at larger shapes each expert on
its sorted rows). Every TP rank routes alike (same input, same router); the experts' partial
outputs (row-parallel fc2) are summed over TP once, after the weighted sum (linear).
For the backward, the routing weights enter the TP-split computation through the same
copy as a column-parallel layer's input, so the router's gradient is summed over TP and
equal on every rank.

Training adds the router's load-balancing loss (Switch Transformer's, as transformers'
``load_balancing_loss_func`` computes it for Qwen3-MoE) and reads each layer's expert
load: a :class:`RouterRecord` set on the layers (:func:`recording`) keeps what one
forward routed, and :func:`load_balancing_loss` and :func:`expert_load` turn it into
the loss and the metrics.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator, cast

import torch
import torch.nn.functional as F

from planner.specs.model_spec import ModelSpec
from planner.specs.param_layout import expert_tensors
from realign.runtime.ep_groups import local_experts
from realign.runtime.moe_dispatch import dispatch_experts
from realign.runtime.moe_experts import dense_experts, experts_dense, experts_sorted

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
    """The experts this rank holds, keyed by their global index (all of them without
    expert parallelism), so parameter names are the planner's logical names."""

    def __init__(self, experts: dict[int, _Expert]):
        super().__init__()
        self.local_experts = torch.nn.ModuleDict({str(e): ex for e, ex in experts.items()})


class MoeMLP(torch.nn.Module):
    """Sparse layer ``layer``'s router and experts, this rank's shards.

    ``init_seed``: random weights (normal, ``std``), each full tensor drawn from its own
    generator seeded by (seed, layer, tensor) and then sliced, so every TP and EP layout
    of a seed holds the same model; None: zeros (weights come from a checkpoint).
    ``tp_group``: the replica's TP group (None at TP 1). ``ep_group``: this rank's EP
    group (:mod:`realign.runtime.ep_groups`; None without expert parallelism), of which
    it is rank ``ep_rank`` holding experts ``local_experts(E, ep, ep_rank)``; tokens reach
    the other ranks' experts through :func:`realign.runtime.moe_dispatch.dispatch_experts`."""

    def __init__(self, spec: ModelSpec, layer: int, tp: int, tp_rank: int, tp_group,
                 dtype: torch.dtype, device: torch.device, init_seed: int | None = None,
                 std: float = 0.02, ep: int = 1, ep_rank: int = 0, ep_group=None):
        super().__init__()
        assert spec.moe is not None and spec.is_sparse(layer)
        assert (ep == 1) == (ep_group is None), "an EP group exactly when ep > 1"
        self.top_k, self.norm_topk_prob = spec.moe.top_k, spec.moe.norm_topk_prob
        self.n_experts = spec.moe.n_experts
        self.tp_group, self.ep_group = tp_group, ep_group
        #: where a training forward records its routing (:func:`recording`); None: nowhere
        self.record: RouterRecord | None = None
        #: the experts to route to instead of the router's top-k (rollout routing replay,
        #: :func:`realign.runtime.router_replay.replaying`); None: the router's own
        self.replay: torch.Tensor | None = None
        tensors = expert_tensors(spec, layer)
        router, fc = tensors[0], tensors[1:]
        mine = local_experts(self.n_experts, ep, ep_rank)
        self.router = _Weight(router.shape, dtype, device)
        self.experts = _Experts({e: _Expert(fc[2 * e].shard_shape(tp),
                                            fc[2 * e + 1].shard_shape(tp), dtype, device)
                                 for e in mine})
        if ep > 1:
            # megatron's mark of an expert-parallel parameter: its DDP sums the gradient
            # over the expert-data-parallel group (the ranks holding the same experts),
            # not the whole DP group, and its optimizer steps it apart, with the
            # gradient norm over TP x EP x PP (:func:`realign.runtime.groups.build_replica_groups`)
            for p in self.experts.parameters():
                p.allreduce = False  # type: ignore[attr-defined]
        if init_seed is None:
            return
        params: dict[int, torch.Tensor] = {0: self.router.weight}
        for e, ex in self.held().items():
            params.update({1 + 2 * e: ex.linear_fc1.weight, 2 + 2 * e: ex.linear_fc2.weight})
        with torch.no_grad():
            for i, w in params.items():
                t = tensors[i]
                g = torch.Generator().manual_seed(init_seed * 1_000_003 + layer * 10_007 + i)
                full = torch.randn(t.shape, generator=g) * std
                if t.shard_dim is not None:
                    full = torch.cat([full.narrow(t.shard_dim, a, b - a)
                                      for a, b in t.shard_ranges(tp_rank, tp)], t.shard_dim)
                w.copy_(full.to(dtype))

    def held(self) -> dict[int, _Expert]:
        """This rank's experts by global expert index."""
        return {int(e): cast(_Expert, ex) for e, ex in self.experts.local_experts.items()}

    def fc1s(self) -> dict[int, torch.Tensor]:
        """This rank's experts' fc1 weights by global expert index."""
        return {e: ex.linear_fc1.weight for e, ex in self.held().items()}

    def fc2s(self) -> dict[int, torch.Tensor]:
        """This rank's experts' fc2 weights by global expert index."""
        return {e: ex.linear_fc2.weight for e, ex in self.held().items()}

    def mlp(self, y: torch.Tensor, copy: Mapping = _same, reduce: Mapping = _same,
            replay: torch.Tensor | None = None) -> torch.Tensor:
        """The layer's MLP output for its normed input ``y`` [..., h] (``copy``,
        ``reduce``: the TP mappings of a column- and a row-parallel layer; ``replay``:
        experts to force, read by the caller from :attr:`replay` when the forward ran,
        so a recomputation in the backward forces the same; None: :attr:`replay`)."""
        return moe_forward(y, self.router.weight, self.fc1s(), self.fc2s(), self.top_k,
                           self.norm_topk_prob, copy, reduce, self.record, self.ep_group,
                           self.n_experts,
                           replay=replay if replay is not None else self.replay)

    def join_exchange(self) -> None:
        """This layer's token exchange with none of this rank's own tokens: the tokens
        the other ranks of the EP group send are run on this rank's experts and sent
        back. What a rank that has finished its generation call runs while another
        rank of its group still runs a forward (:mod:`realign.runtime.engines.ep_lockstep`)."""
        assert self.ep_group is not None, "only with expert parallelism"
        w = self.router.weight
        x = torch.zeros(0, w.shape[1], dtype=w.dtype, device=w.device)
        fc2s = self.fc2s()
        dispatch_experts(x, torch.zeros(0, self.top_k, dtype=w.dtype, device=w.device),
                         torch.zeros(0, self.top_k, dtype=torch.long, device=w.device),
                         self.fc1s(), fc2s, self.n_experts, self.ep_group,
                         next(iter(fc2s.values())).shape[0])

    def forward(self, hidden: torch.Tensor, padding_mask=None):
        """Megatron's MLP call: ``[s, b, h] -> ([s, b, h], None)``."""
        copy, reduce = tp_mappings(self.tp_group)
        return self.mlp(hidden, copy, reduce), None


class RouterRecord:
    """What the sparse layers of one forward routed, in layer order: per layer the
    router's probabilities (fp32, differentiable) [*lead, experts] and the experts
    chosen [*lead, top_k], ``lead`` being the layer input's leading dimensions ([b, s]
    in realign's decoder, [s, b] in megatron's layers)."""

    def __init__(self) -> None:
        self.probs: list[torch.Tensor] = []
        self.experts: list[torch.Tensor] = []

    def add(self, probs: torch.Tensor, experts: torch.Tensor) -> None:
        self.probs.append(probs)
        self.experts.append(experts)


@contextlib.contextmanager
def recording(module: torch.nn.Module) -> Iterator[RouterRecord]:
    """A fresh :class:`RouterRecord` on every :class:`MoeMLP` of ``module`` while the
    block runs (a forward inside it records; the backward's recomputation, after it,
    does not)."""
    record = RouterRecord()
    layers = [m for m in module.modules() if isinstance(m, MoeMLP)]
    for m in layers:
        m.record = record
    try:
        yield record
    finally:
        for m in layers:
            m.record = None


def router_probs(y: torch.Tensor, router: torch.Tensor) -> torch.Tensor:
    """The router's softmax over all experts, in fp32, of tokens ``y`` [T, h]."""
    return torch.softmax(F.linear(y, router), dim=-1, dtype=torch.float32)


def top_k_of(probs: torch.Tensor, top_k: int, norm_topk_prob: bool
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] fp32, experts [T, k]): the ``top_k`` largest probabilities,
    renormalised to sum to 1 when ``norm_topk_prob``."""
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def replayed_top_k(probs: torch.Tensor, forced: torch.Tensor, top_k: int,
                   norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Rollout routing replay's top-k (:mod:`realign.runtime.router_replay`):
    (weights [T, k] fp32, experts [T, k]) of tokens whose router probabilities are
    ``probs`` [T, E], their experts forced to ``forced`` [T, k] (a row holding a -1:
    the router's own top-k); weights are ``probs`` at the experts, renormalised to sum
    to 1 when ``norm_topk_prob``.

    Example: probs [[0.5, 0.3, 0.2]], forced [[2, 1]], top 2, renormalised ->
    experts [[2, 1]], weights [[0.4, 0.6]]."""
    own = torch.topk(probs, top_k, dim=-1).indices
    f = forced.reshape(-1, top_k).to(device=probs.device, dtype=torch.long)
    experts = torch.where((f >= 0).all(dim=-1, keepdim=True), f, own)
    weights = probs.gather(-1, experts)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def route(y: torch.Tensor, router: torch.Tensor, top_k: int, norm_topk_prob: bool
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in ``y``'s dtype, experts [T, k]) of tokens ``y`` [T, h]: softmax
    over all experts in fp32, the top-k, renormalised when ``norm_topk_prob``."""
    weights, experts = top_k_of(router_probs(y, router), top_k, norm_topk_prob)
    return weights.to(y.dtype), experts


def moe_forward(y: torch.Tensor, router: torch.Tensor, fc1s: dict[int, torch.Tensor],
                fc2s: dict[int, torch.Tensor], top_k: int, norm_topk_prob: bool,
                copy: Mapping = _same, reduce: Mapping = _same,
                record: RouterRecord | None = None, ep_group=None,
                n_experts: int = 0, dense: bool | None = None,
                replay: torch.Tensor | None = None) -> torch.Tensor:
    """Routed experts' output for ``y`` [..., h] (the module docstring); ``record``
    keeps the router's probabilities and choices. ``fc1s``, ``fc2s``: the experts this
    rank holds by global index (all of them when ``ep_group`` is None; else their
    share of ``n_experts`` over the EP group, the rest reached by the token exchange).
    ``dense``: the experts' form (:mod:`realign.runtime.moe_experts`): True
    :func:`experts_dense`, False :func:`experts_sorted`, None chosen by the tokens'
    count (:func:`dense_experts`); without EP, a call of at most
    :data:`~realign.runtime.moe_experts.DENSE_MAX_TOKENS` tokens reads nothing on the
    host (a decode step, capturable). ``replay``: the experts to use instead of the
    top-k, [..., top_k] (:func:`replayed_top_k`)."""
    shape = y.shape
    flat = y.reshape(-1, shape[-1])
    probs = router_probs(flat, router)
    if replay is not None:
        weights, experts = replayed_top_k(probs, replay, top_k, norm_topk_prob)
    else:
        weights, experts = top_k_of(probs, top_k, norm_topk_prob)
    if record is not None:
        record.add(probs.reshape(*shape[:-1], -1), experts.reshape(*shape[:-1], top_k))
    # used by TP-split experts: gradient summed over TP
    weights = copy(weights.to(y.dtype))
    x = copy(flat)
    out_dim = next(iter(fc2s.values())).shape[0] if fc2s else shape[-1]
    if ep_group is not None:
        out = dispatch_experts(x, weights, experts, fc1s, fc2s, n_experts, ep_group, out_dim)
        return reduce(out).reshape(shape)
    if dense if dense is not None else dense_experts(flat.shape[0]):
        out = experts_dense(x, weights, experts, fc1s, fc2s)
    else:
        out = experts_sorted(x, weights, experts, fc1s, fc2s, n_experts or len(fc1s))
    return reduce(out).reshape(shape)


def load_balancing_loss(record: RouterRecord, mask: torch.Tensor | None = None
                        ) -> torch.Tensor:
    """The router's load-balancing loss of one forward, as transformers'
    ``load_balancing_loss_func`` computes it for Qwen3-MoE (Switch Transformer's form):
    over every recorded layer's valid tokens (``mask``: the layers' leading shape, true
    where a token is real; None: all), ``f_e`` the share of the token-expert choices that
    went to expert ``e`` and ``P_e`` the mean router probability of ``e``, both pooled over
    the layers; the loss is ``E x sum_e f_e P_e`` (differentiable through ``P_e``).

    Example: 2 experts, top 1, two tokens choosing experts 0 and 0 with probabilities
    (0.75, 0.25) and (0.5, 0.5): f = (1, 0), P = (0.625, 0.375), loss 2 x 0.625 = 1.25.
    Uniform routing gives ``top_k`` (f_e = k/E, P_e = 1/E)."""
    assert record.probs, "no sparse layer recorded"
    n_experts, top_k = record.probs[0].shape[-1], record.experts[0].shape[-1]
    choices = torch.zeros(n_experts, device=record.probs[0].device)
    prob_sum = torch.zeros(n_experts, device=record.probs[0].device)
    rows: torch.Tensor | float = 0.0
    for probs, experts in zip(record.probs, record.experts):
        p, e = probs.reshape(-1, n_experts), experts.reshape(-1, top_k)
        m = (torch.ones(p.shape[0], device=p.device) if mask is None
             else mask.reshape(-1).to(device=p.device, dtype=torch.float32))
        choices = choices.scatter_add(0, e.reshape(-1), m.repeat_interleave(top_k))
        prob_sum = prob_sum + (p * m[:, None]).sum(dim=0)
        rows = rows + m.sum()
    return n_experts * torch.sum((choices / rows) * (prob_sum / rows))


def expert_load(record: RouterRecord, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Token-expert choices per layer and expert [layers, experts] over the valid
    tokens (``mask`` as in :func:`load_balancing_loss`)."""
    n_experts = record.probs[0].shape[-1]
    out = []
    for experts in record.experts:
        e = experts.reshape(-1, experts.shape[-1])
        keep = (torch.ones(e.shape[0], dtype=torch.bool, device=e.device) if mask is None
                else mask.reshape(-1).to(device=e.device, dtype=torch.bool))
        out.append(torch.bincount(e[keep].reshape(-1), minlength=n_experts))
    return torch.stack(out)


def load_summary(load: torch.Tensor) -> dict[str, float]:
    """Each layer's busiest expert against the mean over its experts (1: perfectly
    balanced; ``E / k`` at worst: every token on the same ``k`` experts), summarised:
    ``expert_load_max_over_mean`` (the mean over layers) and ``..._worst`` (the worst
    layer). Example: one layer's counts (6, 2, 0, 0): mean 2, max/mean 3."""
    per_layer = load.float().amax(dim=1) / load.float().mean(dim=1).clamp_min(1e-12)
    return {"expert_load_max_over_mean": float(per_layer.mean()),
            "expert_load_max_over_mean_worst": float(per_layer.max())}


def router_terms(record: RouterRecord, mask: torch.Tensor | None, coef: float
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor | float]]:
    """What a training forward's routing adds: ``coef`` x the load-balancing loss (to add
    to the micro-batch's loss) and the metrics ``router_aux_loss`` and the expert load
    (:func:`load_summary`)."""
    aux = load_balancing_loss(record, mask)
    return coef * aux, {"router_aux_loss": aux.detach(),
                        **load_summary(expert_load(record, mask))}


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
