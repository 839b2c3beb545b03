"""Generation with expert parallelism: the ranks of an EP group in step.

With expert parallelism every sparse layer's forward is a collective over the EP group
(:mod:`realign.runtime.moe_dispatch`: each rank's tokens go to the ranks holding their
experts), so every rank of the group must run the same number of forwards. A generate
call does not: its ranks are data-parallel ranks decoding their own prompts, and one
whose sequences stop early runs fewer decode steps (and, refilling, prefills at other
iterations) than another; so does a packed scoring call, whose token budget gives each
data-parallel rank its own number of bins.

The protocol, per pipeline stage: before each forward (a prefill or a decode step) a
rank says so (:func:`announce_forward`: one all-reduce of a flag over the EP group); a
rank that has finished its call keeps answering (:func:`drain`) with a zero flag and,
while any rank of the group still runs a forward, joins that forward's exchanges with
zero tokens of its own (serving the others' tokens with its experts,
:meth:`realign.runtime.moe.MoeMLP.join_exchange`), until every rank of the group has
finished. The forwards of different ranks need not be of the same kind: the exchanges
are matched per sparse layer, in order, whatever the tokens' count.

Example, EP2, rank 0 decodes 3 steps and rank 1 5: both announce steps 1-3; rank 0
drains, answering rank 1's announcements of steps 4 and 5 and joining their exchanges
with zero tokens; at the next round neither announces and both leave.

Generation announces in :class:`~realign.runtime.engines.decoder.StageDecoder`'s
``prefill`` and ``step`` and drains in
:meth:`~realign.runtime.engines.generate.GenerateEngine.generate`; packed scoring in
:class:`~realign.runtime.engines.inference.InferenceEngine`. A training step needs
neither: its micro-batch count is the same on every rank (a token budget is refused
at EP > 1).

Cost: one small all-reduce per forward on top of the exchanges. Without expert
parallelism nothing runs.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from realign.runtime.model import ModelShard
from realign.runtime.moe import MoeMLP


def _any_forward(running: bool, shard: ModelShard) -> bool:
    """Whether any rank of this rank's EP group runs a forward now (a collective over
    the group; ``running``: this rank does)."""
    flag = torch.tensor([int(running)], device=shard.device.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=shard.groups.ep_group)
    return bool(flag.item())


def announce_forward(shard: ModelShard) -> None:
    """Before each generation forward of this stage at EP > 1 (nothing at EP 1)."""
    if shard.groups.ep > 1:
        _any_forward(True, shard)


def drain(shard: ModelShard) -> int:
    """After this rank's generation call at EP > 1: join the EP group's remaining
    forwards with zero tokens until every rank has finished; returns how many it
    joined (0 at EP 1)."""
    if shard.groups.ep == 1:
        return 0
    layers = [m for m in shard.module.modules() if isinstance(m, MoeMLP)]
    joined = 0
    while _any_forward(False, shard):
        for m in layers:
            m.join_exchange()
        joined += 1
    return joined
