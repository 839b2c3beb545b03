"""Rollout routing replay (R3): a training forward that sends each token to the experts
the rollout's engine chose for it, instead of its own router's top-k, and the share of
tokens whose experts differ between the two.

A mixture of experts' router is discontinuous: a tiny numerical difference between the
rollout engine (vLLM's kernels) and the training forward can flip a token's top-k, and
the training forward then scores the token through other experts than those that
generated it. Replay takes the rollout's expert ids (per token, per sparse layer:
:mod:`realign.runtime.engines.vllm_routing`) as the top-k; the routing weights are the
training router's own probabilities of those experts (renormalised when the model
renormalises its top-k), so the router still gets its gradient, as megatron-core's
``transformer/moe/router_replay.py`` does. A token with no recorded experts (a row of
-1: padding, or a position the rollout never ran forward) keeps its own top-k.

The forced ids are set per layer on realign's :class:`~realign.runtime.moe.MoeMLP`
(:func:`replaying`), which both realign's decoder and megatron's ``TransformerLayer``
run, so one mechanism serves both forwards; the replayed top-k itself is
:func:`realign.runtime.moe.replayed_top_k`.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch


@contextlib.contextmanager
def replaying(module: torch.nn.Module, experts: Sequence[torch.Tensor]) -> Iterator[None]:
    """While the block runs, the ``i``-th sparse layer (:class:`~realign.runtime.moe.MoeMLP`,
    in module order) of ``module`` routes its tokens to ``experts[i]``, shaped as the
    layer's input's leading dimensions plus ``top_k`` ([b, s, k] in realign's decoder,
    [s, b, k] in megatron's layers). Wrap the forward and its backward (a recomputed
    forward must replay alike)."""
    from realign.runtime.moe import MoeMLP

    layers = [m for m in module.modules() if isinstance(m, MoeMLP)]
    if len(layers) != len(experts):
        raise ValueError(f"{len(experts)} layers of experts to replay for {len(layers)} "
                         "sparse layers")
    for m, e in zip(layers, experts):
        m.replay = e
    try:
        yield
    finally:
        for m in layers:
            m.replay = None


def expert_sets_differ(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per token, whether its expert sets differ at any layer between two routings
    [*lead, layers, k] (order within a set ignored) -> bool [*lead]."""
    return (a.sort(dim=-1).values != b.sort(dim=-1).values).any(dim=-1).any(dim=-1)


def routing_mismatch(rollout: torch.Tensor, training: torch.Tensor) -> tuple[int, int]:
    """(tokens whose expert set differs at some sparse layer, tokens compared) between
    the rollout's routing and the training forward's, both [*lead, layers, k]; tokens
    the rollout did not record (a -1) are not compared. The share is the first over
    the second (``moe.routing_mismatch``).

    Example: two tokens, one layer, top 2: rollout [[[1, 2]], [[3, 4]]], training
    [[[2, 1]], [[3, 5]]] -> (1, 2)."""
    known = (rollout >= 0).all(dim=-1).all(dim=-1)
    differ = expert_sets_differ(rollout, training.to(rollout.device)) & known
    return int(differ.sum()), int(known.sum())
