"""Reward modelling with the Bradley-Terry pairwise loss (Ouyang et al. 2022, eq. 1):
L = -log sigma(s(x, y_c) - s(x, y_r)), where a sequence's score is the value head's
output at its last token, ``values[i, length_i - 1]``.

Rows are interleaved pairs: 2i chosen, 2i+1 rejected (micro-batches must hold whole
pairs).
"""
from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from realign.algorithms.common import Batch, pairs, require
from realign.algorithms.params import RMConfig


def sequence_scores(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """values[i, lengths[i] - 1], [b]."""
    return values.gather(1, (lengths.long() - 1).unsqueeze(1)).squeeze(1)


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """-log sigma(s_c - s_r) per pair, [n]."""
    return -F.logsigmoid(chosen - rejected)


@torch.no_grad()
def prepare(batch: Batch, cfg: RMConfig) -> Batch:
    """Checks the pairs; the batch is otherwise ready."""
    require(batch, "tokens", "lengths")
    pairs(batch["tokens"], "batch.tokens")
    return batch


def reward_loss(values_new: torch.Tensor, batch: Batch, cfg: RMConfig
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Mean Bradley-Terry loss over the pairs. Metrics: accuracy (s_c > s_r), margin,
    score_chosen, score_rejected."""
    chosen, rejected = pairs(sequence_scores(values_new, batch["lengths"]), "batch.tokens")
    loss = bradley_terry_loss(chosen, rejected).mean()
    with torch.no_grad():
        metrics = {"accuracy": (chosen > rejected).float().mean(),
                   "margin": (chosen - rejected).mean(),
                   "score_chosen": chosen.mean(), "score_rejected": rejected.mean()}
    return loss, metrics


def reward_loss_fn(cfg: RMConfig):
    """``loss_fn(values, micro_batch)`` of the reward model for the training engine."""
    return partial(reward_loss, cfg=cfg)
