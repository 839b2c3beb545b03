"""DPO (Rafailov et al. 2023, "Direct Preference Optimization") and IPO (Azar et al.
2023, "A General Theoretical Paradigm to Understand Learning from Human Preferences").

With sequence log-probs log pi(y|x) = sum of the response tokens' log-probs and
    h = (log pi(y_c) - log ref(y_c)) - (log pi(y_r) - log ref(y_r)):
    sigmoid: L = -(1 - ls) log sigma(beta h) - ls log sigma(-beta h)   (ls: label
             smoothing, conservative DPO; ls = 0 is the paper's loss)
    ipo:     L = (h - 1/(2 beta))^2
Implicit rewards: beta * (log pi - log ref) of each response.

Rows are interleaved pairs: 2i chosen, 2i+1 rejected (micro-batches must hold whole
pairs).
"""
from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from realign.algorithms.common import Batch, batch_mask, pairs, require, sequence_logprob
from realign.algorithms.params import DPOConfig, PreferenceParams


def preference_loss(chosen_logratio: torch.Tensor, rejected_logratio: torch.Tensor,
                    cfg: PreferenceParams) -> torch.Tensor:
    """Per-pair loss [n] from log pi - log ref of the chosen and rejected responses."""
    h = chosen_logratio - rejected_logratio
    if cfg.loss == "ipo":
        return (h - 1 / (2 * cfg.beta)) ** 2
    ls = cfg.label_smoothing
    return -(1 - ls) * F.logsigmoid(cfg.beta * h) - ls * F.logsigmoid(-cfg.beta * h)


@torch.no_grad()
def prepare(batch: Batch, cfg: DPOConfig) -> Batch:
    """Checks the pairs and the reference log-probs; the batch is otherwise ready."""
    require(batch, "ref_logprobs", "prompt_lengths")
    pairs(batch["tokens"], "batch.tokens")
    return batch


def actor_loss(logprobs_new: torch.Tensor, batch: Batch, cfg: DPOConfig
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Mean preference loss over the micro-batch's pairs. Metrics: reward_chosen,
    reward_rejected, reward_margin, reward_accuracy (implicit rewards)."""
    mask = batch_mask(batch)
    logratio = sequence_logprob(logprobs_new, mask) - sequence_logprob(batch["ref_logprobs"], mask)
    chosen, rejected = pairs(logratio, "batch.tokens")
    loss = preference_loss(chosen, rejected, cfg).mean()
    with torch.no_grad():
        r_c, r_r = cfg.beta * chosen, cfg.beta * rejected
        metrics = {"reward_chosen": r_c.mean(), "reward_rejected": r_r.mean(),
                   "reward_margin": (r_c - r_r).mean(),
                   "reward_accuracy": (r_c > r_r).float().mean()}
    return loss, metrics


def actor_loss_fn(cfg: DPOConfig):
    """``loss_fn(logprobs, micro_batch)`` of the policy for the training engine."""
    return partial(actor_loss, cfg=cfg)
