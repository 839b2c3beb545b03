"""Expert parallelism's token exchange: a sparse layer's experts spread over the ranks
of an EP group (:mod:`realign.runtime.ep_groups`), each token-expert choice sent with
``all_to_all`` to the rank holding its expert, run there, and sent back.

Per layer and forward, on every rank of the EP group (each with its own tokens, as the
group's ranks are data-parallel ranks): route locally (the router is whole on every
rank), sort the ``T x top_k`` choices by the EP rank owning their expert, exchange the
counts, then the tokens' hidden states and expert ids (``all_to_all_single`` with uneven
splits: gloo's list form takes equal sizes only), run each local expert on what it
received (:func:`~realign.runtime.moe_experts.experts_sorted`), send the outputs back
the same way and sum them into the tokens, weighted by the routing weights. The exchange
is differentiable (:class:`_AllToAll`: its backward is the reverse exchange), so a
training step's gradients flow to the experts on other ranks and back to the tokens and
the router. With TP inside each EP rank, the ranks of one TP position exchange among
themselves (all hold the same tokens per TP group) and the experts' partial outputs are
summed over TP once, after the weighted sum, as without EP.

The exchange's split sizes are read on the host (``all_to_all_single`` takes them as
lists), so a step with EP synchronises with the host per sparse layer and is not
captured in a CUDA graph; the dense form of :mod:`realign.runtime.moe_experts` is for
layers whose experts are all on the rank.

Every rank of an EP group must run the same number of sparse-layer forwards (the
exchange is a collective), also when it has no token for another rank.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from realign.runtime.moe_experts import experts_sorted

Mapping = Callable[[torch.Tensor], torch.Tensor]


class _AllToAll(torch.autograd.Function):
    """Rows of ``x`` split by ``send`` counts go to the group's ranks in order; the
    result stacks what arrives (``recv`` counts). Backward: the reverse exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _exchange(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad.contiguous(), ctx.recv, ctx.send, ctx.group), None, None, None


def _exchange(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    out = torch.empty((sum(recv), *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv,
                           input_split_sizes=send, group=group)
    return out


def exchange_counts(send: torch.Tensor, group) -> torch.Tensor:
    """What each rank of ``group`` sends to this one, from this rank's ``send`` counts."""
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv


def dispatch_experts(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                     fc1s: dict[int, torch.Tensor], fc2s: dict[int, torch.Tensor],
                     n_experts: int, ep_group, out_dim: int) -> torch.Tensor:
    """Routed experts' output [T, out_dim] of tokens ``x`` [T, h] chosen ``experts``
    [T, k] with ``weights`` [T, k], the experts spread over ``ep_group`` (this rank
    holding ``fc1s``/``fc2s``, keyed by global expert index)."""
    ep = dist.get_world_size(ep_group)
    per = n_experts // ep
    k = experts.shape[1]
    flat = experts.reshape(-1)
    token = torch.arange(x.shape[0], device=x.device).repeat_interleave(k)
    order = torch.argsort(torch.div(flat, per, rounding_mode="floor"), stable=True)
    send_counts = torch.bincount(torch.div(flat, per, rounding_mode="floor"), minlength=ep)
    recv_counts = exchange_counts(send_counts, ep_group)
    send, recv = send_counts.tolist(), recv_counts.tolist()
    got_x = _AllToAll.apply(x[token[order]], send, recv, ep_group)
    got_e = _exchange(flat[order].contiguous(), send, recv, ep_group)
    done = experts_sorted(got_x, None, got_e[:, None], fc1s, fc2s, n_experts)
    back = _AllToAll.apply(done, recv, send, ep_group)
    scaled = back * weights.reshape(-1)[order, None]
    return torch.zeros(x.shape[0], out_dim, dtype=x.dtype, device=x.device).index_add(
        0, token[order], scaled)
