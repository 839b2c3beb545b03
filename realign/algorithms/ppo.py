"""PPO for RLHF (Schulman et al. 2017, "Proximal Policy Optimization Algorithms";
Ouyang et al. 2022, "Training language models to follow instructions with human
feedback").

Per iteration, on the rollout:
    r_t = -beta * KL_t            (+ score on the last response token)
    delta_t = r_t + gamma * V_{t+1} - V_t,  A_t = delta_t + gamma * lam * A_{t+1}   (GAE)
    R_t = A_t + V_t,  A <- whiten(A)
then per minibatch:
    actor:  -min(ratio * A, clip(ratio, 1 +- eps) * A)   [+ beta * KL(pi || ref) if the
            KL is a loss instead of a reward term]
    critic: 1/2 max((V - R)^2, (clip(V, V_old +- eps_v) - R)^2)

Values: the critic's output at position ``t`` (state ``tokens[:t+1]``) is the value of
the state in which log-prob position ``t`` acts, so ``values[:, :-1]`` lines up with
the [b, s-1] log-prob positions; the value after the last response token is 0.
"""
from __future__ import annotations

from functools import partial

import torch

from realign.algorithms.common import (
    Batch,
    batch_mask,
    kl_penalty,
    last_token_scores,
    masked_mean,
    masked_whiten,
    policy_surrogate,
    require,
    rollout_ref_logprobs,
    token_kl,
)
from realign.algorithms.params import KLEstimator, PPOConfig


def token_rewards(rewards: torch.Tensor, logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
                  mask: torch.Tensor, kl_coef: float,
                  kl_estimator: KLEstimator = "k1") -> torch.Tensor:
    """r_t = -kl_coef * KL_t on response tokens, plus the sequence score ``rewards[i]``
    on the last response token. [b, s-1], zero outside ``mask``."""
    kl = token_kl(logprobs, ref_logprobs, mask, kl_estimator)
    return -kl_coef * kl + last_token_scores(rewards, mask)


def gae(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
        gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) over each row's response.

    ``values`` [b, s-1] are aligned with the rewards (``critic values[:, :-1]``);
    the value past the last response token is 0. Returns (advantages, returns =
    advantages + values), both zero outside ``mask``.

    A mask with holes (a multi-turn rollout's observation tokens) is walked over the
    masked positions only: the next value of a model token is that of the next model
    token, across the observation between them, which is neither a state the policy
    acts in nor discounted. Example: mask [1, 0, 1], gamma = lam = 1, rewards
    [0, 0, 1], values [v0, -, v2]: A2 = 1 - v2, A0 = (0 + v2 - v0) + A2 = 1 - v0.
    """
    r, v = token_rewards * mask, values * mask
    n = r.shape[1]
    adv = torch.zeros_like(r)
    running = torch.zeros_like(r[:, 0])
    next_v = torch.zeros_like(running)
    for t in reversed(range(n)):
        m = mask[:, t] > 0
        delta = r[:, t] + gamma * next_v - v[:, t]
        running = torch.where(m, delta + gamma * lam * running, running)
        next_v = torch.where(m, v[:, t], next_v)
        adv[:, t] = running
    return adv * mask, (adv + v) * mask


@torch.no_grad()
def prepare(batch: Batch, cfg: PPOConfig) -> Batch:
    """Rollout (``rewards``, ``logprobs``, ``values``, ``ref_logprobs`` if a reference
    model runs) -> the batch
    with ``advantages`` and ``returns`` [b, s-1]."""
    require(batch, "rewards", "logprobs", "values")
    mask = batch_mask(batch)
    kl_coef = cfg.kl_coef if cfg.kl_in_reward else 0.0
    r = token_rewards(batch["rewards"], batch["logprobs"], rollout_ref_logprobs(batch), mask,
                      kl_coef, cfg.kl_estimator)
    adv, ret = gae(r, batch["values"][:, :-1].float(), mask, cfg.gamma, cfg.lam)
    if cfg.normalize_advantages:
        adv = masked_whiten(adv, mask)
    return {**batch, "advantages": adv, "returns": ret}


def actor_loss(logprobs_new: torch.Tensor, batch: Batch, cfg: PPOConfig
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate over the response tokens (decoupled with ``prox_logprobs``: see
    :func:`~realign.algorithms.common.policy_surrogate`), plus ``kl_coef * KL(pi || ref)``
    when the KL is not in the reward. Metrics: clip_frac, approx_kl, ratio, kl (k1 to
    ref) (+ behave_weight*, asynchronous)."""
    mask = batch_mask(batch)
    loss, metrics = policy_surrogate(logprobs_new, batch, cfg.clip_ratio, "token_mean",
                                     cfg.importance_cap)
    if not cfg.kl_in_reward and cfg.kl_coef > 0:
        kl = masked_mean(kl_penalty(logprobs_new, batch["ref_logprobs"], cfg.kl_estimator), mask)
        loss = loss + cfg.kl_coef * kl
    if "ref_logprobs" in batch:              # no reference model: no KL to report
        with torch.no_grad():
            metrics["kl"] = masked_mean(logprobs_new - batch["ref_logprobs"], mask)
    return loss, metrics


def critic_loss(values_new: torch.Tensor, batch: Batch, cfg: PPOConfig
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """1/2 * max((V - R)^2, (V_old + clip(V - V_old, +-value_clip) - R)^2), masked mean.
    ``values_new`` [b, s] is the value head's output. Metrics: value_clip_frac, value."""
    mask = batch_mask(batch)
    v, old, ret = values_new[:, :-1], batch["values"][:, :-1], batch["returns"]
    v_clipped = old + torch.clamp(v - old, -cfg.value_clip, cfg.value_clip)
    err, err_clipped = (v - ret) ** 2, (v_clipped - ret) ** 2
    loss = 0.5 * masked_mean(torch.max(err, err_clipped), mask)
    with torch.no_grad():
        metrics = {"value_clip_frac": masked_mean((err_clipped > err).float(), mask),
                   "value": masked_mean(v, mask)}
    return loss, metrics


def actor_loss_fn(cfg: PPOConfig):
    """``loss_fn(logprobs, micro_batch)`` of the actor for the training engine."""
    return partial(actor_loss, cfg=cfg)


def critic_loss_fn(cfg: PPOConfig):
    """``loss_fn(values, micro_batch)`` of the critic for the training engine."""
    return partial(critic_loss, cfg=cfg)
