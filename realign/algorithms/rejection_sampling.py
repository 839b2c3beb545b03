"""Rejection sampling, best-of-N fine-tuning (RAFT: Dong et al. 2023, "RAFT: Reward
rAnked FineTuning for Generative Foundation Model Alignment"): each prompt's N
samples are scored (the reward model, or the reward function on the text), the best
is kept and the actor trains SFT on it; every step does it again with the updated
policy.

    y*(x) = argmax_i r(x, y_i)      (the first of equals)
    L = -1/|M| sum_{t in M} log pi(y*_t | y*_<t, x)   over the kept responses' tokens

With ``min_reward`` a prompt whose best response scores below it weighs 0: its row
stays in the batch, so the train call trains one row per prompt, the count the plan
prices (:func:`planner.graph.algorithms.rejection_sampling`).
"""
from __future__ import annotations

from functools import partial

import torch

from realign.algorithms.common import Batch, aggregate, batch_mask, require, with_stats
from realign.algorithms.params import RejectionSamplingConfig
from realign.algorithms.selection import best_in_groups, select_rows


@torch.no_grad()
def prepare(batch: Batch, cfg: RejectionSamplingConfig) -> Batch:
    """The best response of each prompt (one row per prompt) with its ``loss_mask``
    (response tokens; none for a prompt whose best is below ``min_reward``). Statistics:
    ``kept_frac`` (share of the generated responses trained on), ``best_reward_mean``
    (mean reward of the prompts' best responses)."""
    require(batch, "rewards")
    best = best_in_groups(batch["rewards"], cfg.samples_per_prompt,
                          "algorithm.samples_per_prompt")
    out = select_rows(batch, best)
    rewards = out["rewards"].float()
    keep = (torch.ones_like(rewards) if cfg.min_reward is None
            else (rewards >= cfg.min_reward).float())
    out["loss_mask"] = batch_mask(out) * keep.unsqueeze(1)
    return with_stats(out, kept_frac=float(keep.sum()) / batch["tokens"].shape[0],
                      best_reward_mean=float(rewards.mean()))


def actor_loss(logprobs_new: torch.Tensor, batch: Batch, cfg: RejectionSamplingConfig
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SFT's masked NLL over the kept responses. Metrics: tokens (trained on, in the
    micro-batch)."""
    require(batch, "loss_mask")
    mask = batch["loss_mask"]
    return aggregate(-logprobs_new, mask, cfg.loss_agg), {"tokens": mask.sum().detach()}


def actor_loss_fn(cfg: RejectionSamplingConfig):
    """``loss_fn(logprobs, micro_batch)`` of the policy for the training engine."""
    return partial(actor_loss, cfg=cfg)
