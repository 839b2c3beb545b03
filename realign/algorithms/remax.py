"""ReMax (Li et al. 2023, "ReMax: A Simple, Effective, and Efficient Reinforcement
Learning Method for Aligning Large Language Models"): REINFORCE whose baseline is the
reward of the greedy response to the same prompt.

    r_i = score(x, a_i) - beta * sum_t KL_k1,t(a_i)       (KL-regularised reward)
    A_i = r_i - score(x, greedy(x))                       on every token of a_i
    L = -min(ratio * A, clip(ratio, 1 +- eps) * A)

With one update per batch the ratio is 1 and the gradient is exactly ReMax's
sum_t grad log pi(a_t) * (r(a) - r(greedy)).
"""
from __future__ import annotations

from functools import partial

import torch

from realign.algorithms.common import (
    Batch,
    batch_mask,
    broadcast_to_tokens,
    require,
    rollout_ref_logprobs,
    surrogate_actor_loss,
    token_kl,
)
from realign.algorithms.params import ReMaxConfig
from realign.errors import UserError


def greedy_baseline_advantages(rewards: torch.Tensor, greedy_rewards: torch.Tensor,
                               samples_per_prompt: int = 1) -> torch.Tensor:
    """A_i = r_i - r_greedy(prompt of i), [b]. ``greedy_rewards`` has one row per
    prompt (b / samples_per_prompt) or one per sample (b, already repeated)."""
    b = rewards.shape[0]
    if greedy_rewards.shape[0] * samples_per_prompt == b:
        greedy_rewards = greedy_rewards.repeat_interleave(samples_per_prompt)
    elif greedy_rewards.shape[0] != b:
        raise UserError(f"greedy_rewards has {greedy_rewards.shape[0]} rows; expected one "
                        f"per prompt ({b // samples_per_prompt}) or per sample ({b})",
                        field="batch.greedy_rewards")
    return rewards.float() - greedy_rewards.float()


@torch.no_grad()
def prepare(batch: Batch, cfg: ReMaxConfig) -> Batch:
    """Adds ``advantages`` [b, s-1]; ``greedy_rewards`` is consumed (it has one row per
    prompt, not per sequence, so it leaves the training batch)."""
    require(batch, "rewards", "greedy_rewards", "logprobs")
    mask = batch_mask(batch)
    kl = token_kl(batch["logprobs"], rollout_ref_logprobs(batch), mask, "k1").sum(1)
    adv = greedy_baseline_advantages(batch["rewards"].float() - cfg.kl_coef * kl,
                                     batch["greedy_rewards"], cfg.samples_per_prompt)
    out = {k: v for k, v in batch.items() if k != "greedy_rewards"}
    return {**out, "advantages": broadcast_to_tokens(adv, mask)}


#: the loss: the clipped surrogate of the advantages above (KL is in the reward)
actor_loss = surrogate_actor_loss


def actor_loss_fn(cfg: ReMaxConfig):
    """``loss_fn(logprobs, micro_batch)`` of the actor for the training engine."""
    return partial(actor_loss, cfg=cfg)
