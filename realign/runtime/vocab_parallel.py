"""Per-token log-probabilities from vocabulary-parallel logits, over an explicit TP
group (megatron's own cross entropy reads the global TP group).

Logits of the vocabulary padding (ids ``>= vocab_size``) are excluded, so the
log-probabilities equal those of the unpadded Hugging Face model.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class _TokenLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, tp_group, vocab_size):
        # logits [..., V/tp] (this rank's vocabulary slice), targets [...]
        part = logits.shape[-1]
        rank = dist.get_rank(tp_group) if tp_group is not None else 0
        start = rank * part
        logits = logits.float()
        ids = torch.arange(start, start + part, device=logits.device)
        logits = logits.masked_fill(ids >= vocab_size, float("-inf"))
        lmax = logits.max(dim=-1).values
        _all_reduce(lmax, dist.ReduceOp.MAX, tp_group)
        shifted = logits - lmax.unsqueeze(-1)
        exp = shifted.exp()
        sumexp = exp.sum(dim=-1)
        _all_reduce(sumexp, dist.ReduceOp.SUM, tp_group)
        local = targets - start
        inside = (local >= 0) & (local < part)
        picked = shifted.gather(-1, local.clamp(0, part - 1).unsqueeze(-1)).squeeze(-1)
        picked = torch.where(inside, picked, torch.zeros_like(picked))
        _all_reduce(picked, dist.ReduceOp.SUM, tp_group)
        ctx.save_for_backward(exp / sumexp.unsqueeze(-1), local, inside)
        ctx.part = part
        return picked - sumexp.log()

    @staticmethod
    def backward(ctx, grad):
        softmax, local, inside = ctx.saved_tensors
        g = -softmax * grad.unsqueeze(-1)
        onehot = torch.nn.functional.one_hot(local.clamp(0, ctx.part - 1), ctx.part)
        g = g + onehot * (grad * inside).unsqueeze(-1)
        return g, None, None, None


def _all_reduce(t, op, group) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, tp_group,
                   vocab_size: int) -> torch.Tensor:
    """``log softmax(logits)[target]`` for vocabulary-parallel ``logits`` [..., V/tp].
    Differentiable; float32 result of shape ``targets.shape``.

    Without tensor parallelism the whole vocabulary is here, and torch's fused
    ``log_softmax`` (with its own backward) does the same in fewer kernels: half the
    time of the parallel version's forward and backward on the tiny CPU models."""
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return local_token_logprobs(logits, targets, vocab_size)
    return parallel_token_logprobs(logits, targets, tp_group, vocab_size)


def local_token_logprobs(logits: torch.Tensor, targets: torch.Tensor,
                         vocab_size: int) -> torch.Tensor:
    """:func:`token_logprobs` of logits [..., padded V] holding the whole vocabulary."""
    logp = logits[..., :vocab_size].float().log_softmax(-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def parallel_token_logprobs(logits: torch.Tensor, targets: torch.Tensor, tp_group,
                            vocab_size: int) -> torch.Tensor:
    """The vocabulary-parallel computation, whatever the group's size."""
    return _TokenLogProbs.apply(logits, targets, tp_group, vocab_size)
