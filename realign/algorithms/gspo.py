"""GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv 2507.18071):
GRPO's group-normalised advantages with one importance ratio per sequence, the
length-normalised likelihood ratio, clipped per sequence:

    s_i = (pi(y_i|x) / pi_old(y_i|x)) ^ (1/|y_i|) = exp(1/|y_i| sum_t (log pi - log pi_old))
    L = 1/G sum_i -min(s_i * A_i, clip(s_i, 1 - eps_low, 1 + eps_high) * A_i)

A token's ratio noise averages out in s_i, so its clip range is tiny (the paper's
3e-4 / 4e-4) and a whole response is kept or clipped together. Example: a response
of two tokens whose log-probs rose by 0.001 and 0.003 has s = exp(0.002) = 1.002,
above 1 + 4e-4: with A > 0 the clipped (constant) term is chosen and the response
gives no gradient.

Asynchronous rollouts (``prox_logprobs``): the ratio is taken against the proximal
policy and the loss weighted per sequence by the truncated behaviour ratio, length
normalised alike: w_i = min(exp(1/|y_i| sum_t (log pi_prox - log pi_behaviour)), cap)
(the decoupled loss of :func:`~realign.algorithms.common.decoupled_surrogate`, per
sequence).
"""
from __future__ import annotations

from functools import partial

import torch

from realign.algorithms.common import (
    Batch,
    aggregate,
    batch_mask,
    clip_sides,
    kl_penalty,
    masked_mean,
    require,
)
from realign.algorithms.params import GSPOConfig


def sequence_surrogate(logprobs: torch.Tensor, batch: Batch, cfg: GSPOConfig
                       ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped sequence-ratio loss, a mean over the sequences that have response
    tokens. Metrics (shares of those sequences): clip_frac, clip_frac_low,
    clip_frac_high; ratio (mean s_i), approx_kl (mean token log pi_old - log pi)
    (+ behave_weight, behave_weight_capped_frac asynchronous)."""
    require(batch, "logprobs", "advantages")
    mask = batch_mask(batch)
    has = (mask.sum(1) > 0).float()
    base = batch["prox_logprobs"] if "prox_logprobs" in batch else batch["logprobs"]
    ratio = torch.exp(masked_mean(logprobs - base, mask, dim=1))              # s_i, [b]
    adv = masked_mean(batch["advantages"], mask, dim=1)                       # A_i, [b]
    unclipped = -ratio * adv
    clipped = -torch.clamp(ratio, 1 - cfg.clip_ratio, 1 + cfg.clip_ratio_high) * adv
    per_seq = torch.max(unclipped, clipped)
    metrics: dict[str, torch.Tensor] = {}
    if "prox_logprobs" in batch:
        with torch.no_grad():
            raw = torch.exp(masked_mean(batch["prox_logprobs"] - batch["logprobs"], mask, dim=1))
            weight = raw.clamp(max=cfg.importance_cap)
        per_seq = weight * per_seq
        metrics["behave_weight"] = masked_mean(weight, has)
        metrics["behave_weight_capped_frac"] = masked_mean(
            (raw > cfg.importance_cap).float(), has)
    loss = masked_mean(per_seq, has)
    with torch.no_grad():
        metrics.update(clip_frac=masked_mean((clipped > unclipped).float(), has),
                       approx_kl=masked_mean(base - logprobs, mask),
                       ratio=masked_mean(ratio, has),
                       **clip_sides(ratio, adv, has, cfg.clip_ratio, cfg.clip_ratio_high))
    return loss, metrics


def actor_loss(logprobs_new: torch.Tensor, batch: Batch, cfg: GSPOConfig
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`sequence_surrogate` + kl_coef * KL(pi || ref) (per-sequence token means,
    then their mean). Metrics: those of :func:`sequence_surrogate`, kl."""
    loss, metrics = sequence_surrogate(logprobs_new, batch, cfg)
    if "ref_logprobs" not in batch:          # no reference model (kl_coef is 0)
        return loss, metrics
    kl = aggregate(kl_penalty(logprobs_new, batch["ref_logprobs"], cfg.kl_estimator),
                   batch_mask(batch), "seq_mean_token_mean")
    metrics["kl"] = kl.detach()
    return loss + cfg.kl_coef * kl, metrics


def actor_loss_fn(cfg: GSPOConfig):
    """``loss_fn(logprobs, micro_batch)`` of the actor for the training engine."""
    return partial(actor_loss, cfg=cfg)
