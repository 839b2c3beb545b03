"""Supervised fine-tuning: the negative log-likelihood of the response tokens given
the prompt, L = -1/|M| sum_{t in M} log pi(y_t | y_<t, x), with M the response
positions (``loss_mask``, from ``prompt_lengths``) and, in a conversation, the
positions of its earlier assistant turns (``assistant_mask``); the rest of the prompt
and padding don't count.
"""
from __future__ import annotations

from functools import partial

import torch

from realign.algorithms.common import Batch, aggregate, batch_mask, require
from realign.algorithms.params import SFTConfig


@torch.no_grad()
def prepare(batch: Batch, cfg: SFTConfig) -> Batch:
    """Adds ``loss_mask`` [b, s-1]: 1 on the log-prob positions of response tokens and
    of the earlier assistant turns' tokens (position t scores token t + 1)."""
    mask = batch_mask(batch)
    if "assistant_mask" in batch:
        mask = torch.maximum(mask, batch["assistant_mask"][:, 1:].to(mask.dtype))
    return {**batch, "loss_mask": mask}


def actor_loss(logprobs_new: torch.Tensor, batch: Batch, cfg: SFTConfig
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Masked mean NLL. Metrics: tokens (response tokens in the micro-batch)."""
    require(batch, "loss_mask")
    mask = batch["loss_mask"]
    return aggregate(-logprobs_new, mask, cfg.loss_agg), {"tokens": mask.sum().detach()}


def actor_loss_fn(cfg: SFTConfig):
    """``loss_fn(logprobs, micro_batch)`` of the policy for the training engine."""
    return partial(actor_loss, cfg=cfg)
