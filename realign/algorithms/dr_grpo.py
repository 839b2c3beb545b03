"""Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical
Perspective", arXiv 2503.20783): GRPO without its two normalisations that bias the
optimisation. Dividing the advantage by the group's std weighs prompts that are
nearly always (or never) solved more; dividing each response's token sum by its own
length |o_i| makes a long wrong answer cost less per token than a short one, so
wrong answers grow longer. Dr. GRPO centres the reward only and divides every
response's token sum by one constant, the generation cap:

    A_i = r_i - mean(r_1..r_G)                       on every token of o_i
    L = 1/G sum_i 1/L_max sum_t -min(ratio * A_i, clip(ratio, 1 +- eps) * A_i)
        + beta * KL(pi || pi_ref)  (beta 0 by default)

With L_max = ``gen_len``. Example: rewards 1, 0, 0, 0 -> A = 0.75, -0.25, -0.25,
-0.25 (GRPO: 1.5, -0.5, -0.5, -0.5 over the std 0.5). The loss of a micro-batch of
b rows is its token sum / (b * L_max), so the engine's mean over equal micro-batches
is exactly the step's sum / (rows * L_max).
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
from realign.algorithms.params import DrGRPOConfig


def centred_advantages(rewards: torch.Tensor, samples_per_prompt: int) -> torch.Tensor:
    """r - group mean per sequence (no std), [b]."""
    g = group_view(rewards.float(), samples_per_prompt, "algorithm.samples_per_prompt")
    return (g - g.mean(1, keepdim=True)).reshape(-1)


def constant_norm(per_token: torch.Tensor, mask: torch.Tensor, max_len: int) -> torch.Tensor:
    """sum(per_token * mask) / (rows * max_len): every token weighs the same, whatever
    its response's length."""
    return (per_token * mask).sum() / (per_token.shape[0] * max_len)


@torch.no_grad()
def prepare(batch: Batch, cfg: DrGRPOConfig) -> Batch:
    """Adds ``advantages`` [b, s-1]: the group-centred reward on each response token."""
    require(batch, "rewards")
    adv = centred_advantages(batch["rewards"], cfg.samples_per_prompt)
    return {**batch, "advantages": broadcast_to_tokens(adv, batch_mask(batch))}


def actor_loss(logprobs_new: torch.Tensor, batch: Batch, cfg: DrGRPOConfig
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped surrogate (decoupled with ``prox_logprobs``) under the constant
    normaliser, + kl_coef * KL(pi || ref) alike. Metrics: clip_frac, approx_kl, ratio,
    kl (+ behave_weight*)."""
    agg = partial(constant_norm, max_len=cfg.gen_len)
    loss, metrics = policy_surrogate(logprobs_new, batch, cfg.clip_ratio, agg,
                                     cfg.importance_cap)
    if "ref_logprobs" not in batch:          # no reference model (kl_coef is 0)
        return loss, metrics
    kl = aggregate(kl_penalty(logprobs_new, batch["ref_logprobs"], cfg.kl_estimator),
                   batch_mask(batch), agg)
    metrics["kl"] = kl.detach()
    return loss + cfg.kl_coef * kl, metrics


def actor_loss_fn(cfg: DrGRPOConfig):
    """``loss_fn(logprobs, micro_batch)`` of the actor for the training engine."""
    return partial(actor_loss, cfg=cfg)
