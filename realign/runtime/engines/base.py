"""What every engine of a replica shares: the batch format, the data-parallel split,
megatron's pipeline schedules called with the replica's own groups, and moving
results between stages and data-parallel ranks.

A batch is a dict of tensors whose first dimension is the sequence: ``tokens``
[b, s] (right-padded token ids) and ``lengths`` [b] (valid tokens per sequence),
plus any other per-sequence tensors a loss function needs. Every rank of a replica
is given the same whole batch; data-parallel rank ``d`` works on rows
``[d*b/dp, (d+1)*b/dp)`` and results are gathered back, so every rank returns the
whole batch's result.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from realign.errors import UserError
from realign.runtime.model import ModelShard

Batch = dict[str, torch.Tensor]


def check_batch(batch: Batch, shard: ModelShard, micro_batches: int) -> None:
    """Raise :class:`UserError` for a malformed batch (before any collective)."""
    for key in ("tokens", "lengths"):
        if key not in batch:
            raise UserError(f"the batch lacks {key!r} (has {sorted(batch)})", field="batch")
    tokens, lengths = batch["tokens"], batch["lengths"]
    if tokens.dim() != 2:
        raise UserError(f"tokens must be [batch, seq], got shape {tuple(tokens.shape)}",
                        field="batch.tokens")
    b, s = tokens.shape
    dp = shard.groups.layout.dp
    if b % (dp * micro_batches):
        raise UserError(f"{b} sequences do not split into dp={dp} x micro_batches="
                        f"{micro_batches}", field="batch.tokens")
    if s > shard.spec.max_seq_len:
        raise UserError(f"sequence length {s} exceeds the model's {shard.spec.max_seq_len}",
                        field="batch.tokens")
    if lengths.shape != (b,) or int(lengths.min()) < 1 or int(lengths.max()) > s:
        raise UserError(f"lengths must be [batch] with values in 1..{s}", field="batch.lengths")
    if int(tokens.max()) >= shard.spec.vocab_size or int(tokens.min()) < 0:
        raise UserError(f"token ids must be in 0..{shard.spec.vocab_size - 1}",
                        field="batch.tokens")
    for k, v in batch.items():
        if v.shape[0] != b:
            raise UserError(f"{k} has {v.shape[0]} rows, tokens has {b}", field=f"batch.{k}")


def dp_rows(shard: ModelShard, n: int) -> slice:
    g = shard.groups
    per = n // g.layout.dp
    return slice(g.dp_rank * per, (g.dp_rank + 1) * per)


def split(batch: Batch, parts: int) -> list[Batch]:
    """Split every tensor of ``batch`` into ``parts`` equal row chunks."""
    chunks = {k: v.chunk(parts) for k, v in batch.items()}
    return [{k: chunks[k][i] for k in batch} for i in range(parts)]


def local_batch(batch: Batch, shard: ModelShard) -> Batch:
    rows = dp_rows(shard, batch["tokens"].shape[0])
    dev = shard.device.device
    return {k: v[rows].to(dev) for k, v in batch.items()}


def position_ids(tokens: torch.Tensor) -> torch.Tensor:
    b, s = tokens.shape
    return torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, s)


def run_schedule(shard: ModelShard, model, forward_step: Callable, micro: list,
                 forward_only: bool, collect_non_loss_data: bool,
                 shape: tuple[int, int] | torch.Size | None = None) -> list:
    """Run megatron's schedule (1F1B when pp > 1) over the micro-batches with the
    replica's groups; returns what the last stage's loss function produced. ``shape``:
    the [rows, seq] every micro-batch's forward runs on (default: the first batch's
    ``tokens``; a packed step gives its packs')."""
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    g = shard.groups
    b, s = shape if shape is not None else micro[0]["tokens"].shape
    kwargs = dict(forward_step_func=forward_step, data_iterator=iter(micro), model=[model],
                  num_microbatches=len(micro), seq_length=s, micro_batch_size=b,
                  forward_only=forward_only, collect_non_loss_data=collect_non_loss_data,
                  pg_collection=g.pgs)
    if g.layout.pp == 1:
        return schedules.forward_backward_no_pipelining(**kwargs)
    comm = P2PCommunicator(pp_group=g.pgs.pp, config=shard.config)
    return schedules.forward_backward_pipelining_without_interleaving(
        p2p_communicator=comm, **kwargs)


def from_last_stage(shard: ModelShard, tensor: torch.Tensor | None, shape, dtype
                    ) -> torch.Tensor:
    """Broadcast a tensor computed on the last stage to every stage of this pp group."""
    g = shard.groups
    if g.layout.pp == 1:
        assert tensor is not None           # the only stage is the last
        return tensor
    if tensor is None:
        tensor = torch.empty(shape, dtype=dtype, device=shard.device.device)
    src = g.world_rank(g.tp_rank, g.dp_rank, g.layout.pp - 1)
    dist.broadcast(tensor, src=src, group=g.pgs.pp)
    return tensor


def gather_dp(shard: ModelShard, local: torch.Tensor) -> torch.Tensor:
    """Concatenate each data-parallel rank's rows (equal row counts)."""
    g = shard.groups
    if g.layout.dp == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(g.layout.dp)]
    dist.all_gather(parts, local.contiguous(), group=g.pgs.dp)
    return torch.cat(parts)

