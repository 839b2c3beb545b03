"""Online (iterative) DPO (Guo et al. 2024, "Direct Language Model Alignment from
Online AI Feedback"; Xiong et al. 2024, "Iterative Preference Learning from Human
Feedback: Bridging Theory and Practice for RLHF under KL-Constraint"): every step the
current policy answers each prompt ``samples_per_prompt`` times, the reward model or
the reward function ranks the answers, and the best against the worst is a
preference pair that DPO trains on (:mod:`realign.algorithms.dpo`'s loss, against
the frozen reference).

    chosen = argmax_i r(x, y_i) (the first of equals), rejected = argmin_i (the last)
    L = mean over the step's pairs of w * loss_DPO(chosen, rejected),  w = [r_c > r_r]

A prompt whose answers all score the same gives a tie: its pair stays in the batch
(the train call trains two rows per prompt, as the plan prices:
:func:`planner.graph.algorithms.online_dpo`) with weight 0, and still counts in the
mean, so that the mean over equal micro-batches is the mean over the step's pairs.
"""
from __future__ import annotations

from functools import partial

import torch

from realign.algorithms.common import (
    Batch,
    batch_mask,
    masked_mean,
    pairs,
    require,
    sequence_logprob,
    with_stats,
)
from realign.algorithms.dpo import preference_loss
from realign.algorithms.params import OnlineDPOConfig
from realign.algorithms.selection import best_and_worst, select_rows


@torch.no_grad()
def prepare(batch: Batch, cfg: OnlineDPOConfig) -> Batch:
    """Interleaved pairs (2i: prompt i's best answer, 2i+1: its worst) with
    ``pair_weight`` (1, or 0 for a tie, on both rows). Statistics: ``tied_pair_frac``,
    ``score_margin`` (mean reward of the chosen minus the rejected)."""
    require(batch, "rewards", "ref_logprobs")
    best, worst = best_and_worst(batch["rewards"], cfg.samples_per_prompt,
                                 "algorithm.samples_per_prompt")
    out = select_rows(batch, torch.stack([best, worst], dim=1).flatten())
    r = out["rewards"].float()
    tied = r[0::2] <= r[1::2]
    out["pair_weight"] = (~tied).float().repeat_interleave(2)
    return with_stats(out, tied_pair_frac=float(tied.float().mean()),
                      score_margin=float((r[0::2] - r[1::2]).mean()))


def actor_loss(logprobs_new: torch.Tensor, batch: Batch, cfg: OnlineDPOConfig
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Weighted mean preference loss over the micro-batch's pairs. Metrics (over the
    untied pairs): reward_chosen, reward_rejected, reward_margin, reward_accuracy
    (implicit rewards beta * (log pi - log ref))."""
    require(batch, "pair_weight", "ref_logprobs")
    mask = batch_mask(batch)
    logratio = sequence_logprob(logprobs_new, mask) - sequence_logprob(batch["ref_logprobs"], mask)
    chosen, rejected = pairs(logratio, "batch.tokens")
    w = batch["pair_weight"][0::2]
    loss = (w * preference_loss(chosen, rejected, cfg)).mean()
    with torch.no_grad():
        r_c, r_r = cfg.beta * chosen, cfg.beta * rejected
        metrics = {"reward_chosen": masked_mean(r_c, w), "reward_rejected": masked_mean(r_r, w),
                   "reward_margin": masked_mean(r_c - r_r, w),
                   "reward_accuracy": masked_mean((r_c > r_r).float(), w)}
    return loss, metrics


def actor_loss_fn(cfg: OnlineDPOConfig):
    """``loss_fn(logprobs, micro_batch)`` of the policy for the training engine."""
    return partial(actor_loss, cfg=cfg)
