"""GRPO (Shao et al. 2024, "DeepSeekMath", section 4.1): no critic; each prompt's G
samples are scored and normalised within their group.

    A_i = (r_i - mean(r_1..r_G)) / (std(r_1..r_G) + eps)   on every token of o_i
    L = 1/G sum_i 1/|o_i| sum_t -min(ratio * A_i, clip(ratio, 1 +- eps) * A_i)
        + beta * KL_k3(pi || pi_ref)

A group is ``samples_per_prompt`` consecutive rows; ``std`` is the unbiased sample
standard deviation.
"""
from __future__ import annotations

from functools import partial

import torch

from realign.algorithms.common import (
    Batch,
    aggregate,
    batch_mask,
    broadcast_to_tokens,
    group_view,
    kl_penalty,
    policy_surrogate,
    require,
)
from realign.algorithms.params import GRPOConfig, GSPOConfig


def group_advantages(rewards: torch.Tensor, samples_per_prompt: int,
                     eps: float = 1e-6) -> torch.Tensor:
    """(r - group mean) / (group std + eps) per sequence, [b]."""
    g = group_view(rewards.float(), samples_per_prompt, "algorithm.samples_per_prompt")
    adv = (g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + eps)
    return adv.reshape(-1)


@torch.no_grad()
def prepare(batch: Batch, cfg: GRPOConfig | GSPOConfig) -> Batch:
    """Adds ``advantages`` [b, s-1]: the group-normalised reward on each response token
    (GSPO's too: it differs from GRPO in its loss only)."""
    require(batch, "rewards")
    adv = group_advantages(batch["rewards"], cfg.samples_per_prompt, cfg.eps)
    return {**batch, "advantages": broadcast_to_tokens(adv, batch_mask(batch))}


def actor_loss(logprobs_new: torch.Tensor, batch: Batch, cfg: GRPOConfig
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate (decoupled with ``prox_logprobs``: see
    :func:`~realign.algorithms.common.policy_surrogate`) + kl_coef * KL(pi || ref).
    Metrics: clip_frac, approx_kl, ratio, kl (+ behave_weight*, asynchronous)."""
    mask = batch_mask(batch)
    loss, metrics = policy_surrogate(logprobs_new, batch, cfg.clip_ratio, cfg.loss_agg,
                                     cfg.importance_cap)
    if "ref_logprobs" not in batch:          # no reference model (kl_coef is 0)
        return loss, metrics
    kl = aggregate(kl_penalty(logprobs_new, batch["ref_logprobs"], cfg.kl_estimator), mask,
                   cfg.loss_agg)
    metrics["kl"] = kl.detach()
    return loss + cfg.kl_coef * kl, metrics


def actor_loss_fn(cfg: GRPOConfig):
    """``loss_fn(logprobs, micro_batch)`` of the actor for the training engine."""
    return partial(actor_loss, cfg=cfg)
