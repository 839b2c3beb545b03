"""REINFORCE++ (Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning
Large Language Models"): PPO's token-level KL-penalised reward and clipped update
without a critic; the return is normalised over the whole batch.

    r_t = -beta * KL_k1,t  (+ score on the last response token)
    G_t = sum_{k>=t} gamma^(k-t) r_k
    A = (G - mean_batch(G)) / std_batch(G)            over all response tokens
    L = -min(ratio * A, clip(ratio, 1 +- eps) * A)
"""
from __future__ import annotations

from functools import partial

import torch

from realign.algorithms.common import (
    Batch,
    batch_mask,
    discounted_returns,
    masked_whiten,
    require,
    rollout_ref_logprobs,
    surrogate_actor_loss,
)
from realign.algorithms.params import ReinforcePPConfig
from realign.algorithms.ppo import token_rewards


@torch.no_grad()
def prepare(batch: Batch, cfg: ReinforcePPConfig) -> Batch:
    """Adds ``returns`` (discounted, KL-penalised) and ``advantages`` (the returns
    whitened over the batch's response tokens), both [b, s-1]."""
    require(batch, "rewards", "logprobs")
    mask = batch_mask(batch)
    r = token_rewards(batch["rewards"], batch["logprobs"], rollout_ref_logprobs(batch), mask,
                      cfg.kl_coef, "k1")
    ret = discounted_returns(r, mask, cfg.gamma)
    return {**batch, "returns": ret, "advantages": masked_whiten(ret, mask)}


#: the loss: the clipped surrogate of the advantages above (KL is in the reward)
actor_loss = surrogate_actor_loss


def actor_loss_fn(cfg: ReinforcePPConfig):
    """``loss_fn(logprobs, micro_batch)`` of the actor for the training engine."""
    return partial(actor_loss, cfg=cfg)
