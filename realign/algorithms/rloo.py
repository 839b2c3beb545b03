"""RLOO (Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization
for Learning from Human Feedback in LLMs"; Kool et al. 2019): REINFORCE with a
leave-one-out baseline over the k samples of each prompt.

    r_i = score(x, y_i) - beta * sum_t KL_k1,t(y_i)        (KL-regularised reward)
    A_i = r_i - 1/(k-1) sum_{j != i} r_j = k/(k-1) * (r_i - mean_j r_j)
    L = -min(ratio * A, clip(ratio, 1 +- eps) * A)        (REINFORCE when ratio = 1)

A group is ``samples_per_prompt`` consecutive rows.
"""
from __future__ import annotations

from functools import partial

import torch

from realign.algorithms.common import (
    Batch,
    batch_mask,
    broadcast_to_tokens,
    group_view,
    require,
    rollout_ref_logprobs,
    surrogate_actor_loss,
    token_kl,
)
from realign.algorithms.params import RLOOConfig


def leave_one_out_advantages(rewards: torch.Tensor, samples_per_prompt: int) -> torch.Tensor:
    """A_i = r_i - mean_{j != i} r_j within each group, [b]."""
    k = samples_per_prompt
    g = group_view(rewards.float(), k, "algorithm.samples_per_prompt")
    baseline = (g.sum(1, keepdim=True) - g) / (k - 1)
    return (g - baseline).reshape(-1)


@torch.no_grad()
def prepare(batch: Batch, cfg: RLOOConfig) -> Batch:
    """Adds ``advantages`` [b, s-1]: each response's leave-one-out advantage."""
    require(batch, "rewards", "logprobs")
    mask = batch_mask(batch)
    kl = token_kl(batch["logprobs"], rollout_ref_logprobs(batch), mask, "k1").sum(1)
    adv = leave_one_out_advantages(batch["rewards"].float() - cfg.kl_coef * kl,
                                   cfg.samples_per_prompt)
    return {**batch, "advantages": broadcast_to_tokens(adv, mask)}


#: the loss: the clipped surrogate of the advantages above (KL is in the reward)
actor_loss = surrogate_actor_loss


def actor_loss_fn(cfg: RLOOConfig):
    """``loss_fn(logprobs, micro_batch)`` of the actor for the training engine."""
    return partial(actor_loss, cfg=cfg)
