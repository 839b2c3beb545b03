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

In a run (``rollout.routing_replay``) the rollout's experts travel in the batch as
:data:`ROUTED_EXPERTS` [rows, seq, sparse layers, k]; the scoring and train engines
force them per micro-batch with :func:`replaying_batch`, which lays them out as the
forward's tokens (a pack's: :func:`packed_routing`; megatron's sequence-first layers)
and gives each pipeline stage its own sparse layers (:func:`stage_sparse_layers`).
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


#: the batch key of the rollout's experts, [rows, seq, sparse layers, top_k] (int32; -1
#: where the rollout recorded none), carried by the sequences record of a generate call
#: on vLLM (:func:`realign.runtime.engines.vllm_moe.gathered_routing`) to the actor's
#: scoring and train calls; its sequence axis is the record's ``tokens``'
ROUTED_EXPERTS = "routed_experts"


def stage_sparse_layers(spec, pp: int, pp_rank: int) -> list[int]:
    """The positions, on the routing's layer axis (every sparse layer of the model, in
    order), of the sparse layers pipeline stage ``pp_rank`` of ``pp`` holds.

    Example: 4 layers all sparse, PP2: stage 1 -> [2, 3]; 4 layers of which 0 and 2 are
    sparse (``decoder_sparse_step`` 2), PP2: stage 1 -> [1]."""
    from planner.specs.layout import stage_layers

    sparse = [x for x in range(spec.n_layers) if spec.is_sparse(x)]
    mine = set(stage_layers(spec.n_layers, pp, pp_rank))
    return [j for j, x in enumerate(sparse) if x in mine]


def packed_routing(routed: torch.Tensor, pack) -> torch.Tensor:
    """Rows' experts [n, seq, layers, k] laid out as a pack's tokens
    (:class:`realign.data.packing.Pack` over these rows): [bins, width, layers, k], -1
    at the positions that hold no row's token."""
    bins, width = pack.tokens.shape
    lead = routed.shape[2:]
    out = torch.full((bins * width, *lead), -1, dtype=routed.dtype, device=routed.device)
    s = pack.index.shape[1]
    valid = torch.arange(s, device=pack.index.device) < pack.lengths.unsqueeze(1)
    rows = routed[pack.rows.to(routed.device)][:, :s]
    out[pack.index[valid].to(routed.device)] = rows[valid.to(routed.device)]
    return out.view(bins, width, *lead)


@contextlib.contextmanager
def replaying_batch(shard, routed: torch.Tensor | None, pack=None, seq_first: bool = False
                    ) -> Iterator[None]:
    """While the block runs, the sparse layers of ``shard``'s stage replay ``routed``
    ([rows, seq, layers, k] of the micro-batch, every sparse layer of the model; None:
    nothing replayed), laid out as the forward's tokens: the ``pack``'s when packed, else
    [rows, seq] (``seq_first``: megatron's layers, [seq, rows])."""
    if routed is None:
        yield
        return
    grid = packed_routing(routed, pack) if pack is not None else routed
    if seq_first:
        grid = grid.transpose(0, 1)
    g = shard.groups
    layers = stage_sparse_layers(shard.spec, g.layout.pp, g.pp_rank)
    grid = grid.to(shard.device.device)
    with replaying(shard.module, [grid[..., j, :] for j in layers]):
        yield


def replay_mismatch(record, routed: torch.Tensor, shard, pack=None, seq_first: bool = False
                    ) -> tuple[int, int]:
    """(tokens whose experts differ, tokens compared) between the experts a replayed
    forward's sparse layers used (``record``: :class:`realign.runtime.moe.RouterRecord`
    of this stage's layers) and the rollout's ``routed`` (as :func:`replaying_batch`
    takes it): 0 differ when the replay reached every layer."""
    grid = packed_routing(routed, pack) if pack is not None else routed
    if seq_first:
        grid = grid.transpose(0, 1)
    g = shard.groups
    layers = stage_sparse_layers(shard.spec, g.layout.pp, g.pp_rank)
    if not layers or not record.experts:
        return 0, 0
    used = torch.stack(record.experts, dim=-2)
    return routing_mismatch(grid[..., layers, :].cpu(), used.cpu())


def replayed_share(routed: torch.Tensor, lengths: torch.Tensor) -> float:
    """The share of the rows' scored tokens (each row's positions before its last: the
    tokens whose output predicts a next one) that carry the rollout's experts.

    Example: one row of length 3 whose positions 0 and 1 hold experts and position 2
    none -> 1.0; positions 0 and 2 only -> 0.5."""
    s = routed.shape[1]
    scored = torch.arange(s) < (lengths.cpu() - 1).unsqueeze(1)
    known = (routed.cpu() >= 0).all(dim=-1).all(dim=-1)
    n = int(scored.sum())
    return float((known & scored).sum()) / n if n else 0.0
