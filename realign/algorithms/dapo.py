"""DAPO (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at
Scale", arXiv 2503.14476): GRPO with four changes.

- Clip-higher: the ratio is clipped to [1 - eps_low, 1 + eps_high] with eps_high >
  eps_low (0.2 / 0.28), so a token the policy finds unlikely can grow more before the
  clip stops it.
- Dynamic sampling: groups whose samples all got the same reward carry no advantage;
  they are dropped and the batch is filled with informative groups. Each sampling round
  generates for ``prompts_generated`` prompts (over-sized by the expected share of
  constant groups, ``algorithm.dropped_group_frac``); with ``max_sampling_rounds`` > 1
  the step samples again until ``prompts_per_step`` informative groups are kept
  (:mod:`realign.worker.sampling_loop`: the batch reaching ``prepare`` is then those
  groups), else it trains the first ``prompts_per_step`` informative groups of its one
  round (:func:`~realign.algorithms.selection.keep_informative`); with
  ``rollout.mode: streaming`` the rollout buffer drops the constant groups as they
  finish and the generator keeps generating until a batch is full
  (:mod:`planner.graph.streaming`), so the batch is those groups (marked
  :data:`~realign.algorithms.selection.KEPT_INFORMATIVE`). A step that finds
  too few fills up with constant groups at loss weight 0: the train call trains the
  rows the plan priced, and the metrics say how often (shortfall).
- Token-level loss: one mean over every token of the mini-batch (not a mean of
  per-sequence means), so a long response weighs by its length
  (:func:`~realign.algorithms.common.minibatch_token_mean`: exact across micro-batches
  and data-parallel ranks).
- Overlong reward shaping: with L_max = gen_len and a buffer L_cache,
  R_len(y) = 0 if |y| <= L_max - L_cache, (L_max - L_cache - |y|) / L_cache in the
  buffer, -1 at the cap; times ``overlong_penalty``, added to the reward.

    A_i = (R_i - mean(R_group)) / (std(R_group) + eps),  R_i = r_i + R_len(y_i)
    L = 1 / sum_i |o_i| * sum_i sum_t -min(ratio * A_i, clip(ratio, 1 - eps_low, 1 + eps_high) * A_i)

Groups are judged constant on the reward before the length shaping: the paper drops
prompts whose accuracy is 0 or 1, and a length penalty alone does not make a group
informative about the answer.
"""
from __future__ import annotations

from functools import partial

import torch

from planner.graph.algorithms import prompts_generated
from realign.algorithms.common import (
    Batch,
    aggregate,
    batch_mask,
    broadcast_to_tokens,
    clip_sides,
    kl_penalty,
    minibatch_token_mean,
    policy_surrogate,
    require,
    with_stats,
)
from realign.algorithms.grpo import group_advantages
from realign.algorithms.params import DAPOConfig
from realign.algorithms.selection import KEPT_INFORMATIVE, keep_informative, select_rows
from realign.errors import UserError


def overlong_shaping(response_len: torch.Tensor, max_len: int, buffer_len: int,
                     penalty: float) -> torch.Tensor:
    """DAPO's soft overlong punishment (eq. 13) per response, [b]: 0 up to
    ``max_len - buffer_len`` tokens, then falling linearly to ``-penalty`` at
    ``max_len``. Example: max_len 20, buffer 4, penalty 1: lengths 16, 18, 20 -> 0,
    -0.5, -1."""
    if buffer_len <= 0 or penalty == 0:
        return torch.zeros_like(response_len, dtype=torch.float32)
    over = (max_len - buffer_len - response_len.float()) / buffer_len
    return penalty * over.clamp(min=-1.0, max=0.0)


@torch.no_grad()
def prepare(batch: Batch, cfg: DAPOConfig) -> Batch:
    """The trained groups (dynamic sampling), their ``loss_mask`` (response tokens;
    none for a filler group) and ``advantages`` [rows, s-1] from the length-shaped
    rewards. Statistics: ``shortfall_frac`` (trained groups that are fillers),
    ``overlong_frac`` (trained responses the shaping penalised) and, of a step sampled
    once, ``dropped_group_frac`` (generated groups with a constant reward),
    ``surplus_groups`` (informative groups generated and not trained) and
    ``generated_per_trained`` (groups generated per group trained); a step sampled in
    rounds has these from its rounds (:mod:`realign.worker.sampling_loop`), a streamed
    one from its buffer (``stream.dropped_constant``)."""
    require(batch, "rewards")
    g, wanted = cfg.samples_per_prompt, cfg.prompts_per_step
    generated = batch["tokens"].shape[0] // g
    # the groups kept already: by sampling rounds, or by a stream's buffer
    rounds = cfg.dynamic_sampling and (cfg.max_sampling_rounds > 1
                                       or KEPT_INFORMATIVE in batch)
    expected = wanted if rounds else prompts_generated(wanted, cfg.dropped_group_frac or 0.0)
    if generated != expected:
        raise UserError(f"the step's batch holds {generated} prompts' groups, the batch "
                        f"shape says {expected}", field="algorithm.dropped_group_frac")
    kept = keep_informative(batch["rewards"], g, wanted, "algorithm.samples_per_prompt")
    rows = kept.rows if cfg.dynamic_sampling else torch.arange(wanted * g)
    filler = kept.filler if cfg.dynamic_sampling else torch.zeros(wanted * g, dtype=torch.bool)
    out = select_rows(batch, rows)
    buffer_len = round(cfg.overlong_buffer_frac * cfg.gen_len)
    shaping = overlong_shaping(out["lengths"] - out["prompt_lengths"], cfg.gen_len,
                               buffer_len, cfg.overlong_penalty)
    adv = group_advantages(out["rewards"].float() + shaping, g, cfg.eps)
    mask = batch_mask(out) * (~filler).float().unsqueeze(1)
    out["loss_mask"] = mask
    out["advantages"] = broadcast_to_tokens(adv, mask)
    stats = dict(shortfall_frac=kept.shortfall / wanted if cfg.dynamic_sampling else 0.0,
                 overlong_frac=float((shaping < 0).float().mean()))
    if not rounds:
        stats.update(dropped_group_frac=kept.dropped / generated,
                     surplus_groups=kept.surplus if cfg.dynamic_sampling else 0,
                     generated_per_trained=generated / wanted)
    return with_stats(out, **stats)


def actor_loss(logprobs_new: torch.Tensor, batch: Batch, cfg: DAPOConfig
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clip-higher surrogate (decoupled with ``prox_logprobs``) averaged over the
    mini-batch's tokens, + kl_coef * KL(pi || ref) averaged alike. Metrics: clip_frac,
    clip_frac_low, clip_frac_high, approx_kl, ratio, kl (+ behave_weight*)."""
    require(batch, "loss_mask", "advantages")
    mask = batch["loss_mask"]
    agg = partial(minibatch_token_mean, batch=batch)
    loss, metrics = policy_surrogate(logprobs_new, batch, cfg.clip_ratio, agg,
                                     cfg.importance_cap, cfg.clip_ratio_high, mask=mask)
    base = batch["prox_logprobs"] if "prox_logprobs" in batch else batch["logprobs"]
    metrics.update(clip_sides(torch.exp(logprobs_new.detach() - base), batch["advantages"],
                              mask, cfg.clip_ratio, cfg.clip_ratio_high))
    if "ref_logprobs" not in batch:          # no reference model (kl_coef is 0)
        return loss, metrics
    kl = aggregate(kl_penalty(logprobs_new, batch["ref_logprobs"], cfg.kl_estimator), mask, agg)
    metrics["kl"] = kl.detach()
    return loss + cfg.kl_coef * kl, metrics


def actor_loss_fn(cfg: DAPOConfig):
    """``loss_fn(logprobs, micro_batch)`` of the actor for the training engine."""
    return partial(actor_loss, cfg=cfg)
