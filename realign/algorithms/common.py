"""Pieces every algorithm shares: the response mask, masked statistics, KL estimators,
discounted returns, sequence-level advantages spread over tokens, the clipped
surrogate objective (symmetric or with its own upper clip) and its decoupled form for
asynchronous (off-policy) rollouts, the train call's mini-batches and the statistics
a ``prepare`` step reports.

Shapes: ``b`` sequences of ``s`` tokens; per-token log-probs, advantages and masks are
[b, s-1] (position ``t`` scores token ``t+1``).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable, Union

import torch

from realign.algorithms.params import KLEstimator, LossAgg
from realign.errors import UserError

Batch = dict[str, torch.Tensor]
#: The training engine's loss: ``loss_fn(outputs, micro_batch) -> (loss, metrics)``.
LossFn = Callable[[torch.Tensor, Batch], tuple[torch.Tensor, dict[str, torch.Tensor]]]
#: A reduction of a per-token loss: a named one, or ``fn(per_token, mask) -> scalar``
Aggregate = Union[LossAgg, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]
#: Each row's count in a loss's normaliser, [b] (:class:`TrainLoss`)
RowWeights = Callable[[Batch], torch.Tensor]
#: Keys a ``prepare`` step adds for the train call's metrics (scalars), not to train on
STAT_PREFIX = "stat."


@dataclass(frozen=True)
class TrainLoss:
    """A loss function and what its mean is over: ``weights(batch)`` gives each row's
    count in the denominator of ``fn``'s mean over a micro-batch (1 for a mean over
    rows or pairs, the row's masked tokens for a token mean, 1 or 0 for a mean over
    the sequences that have any).

    ``fn`` returns a micro-batch's mean loss; the training engine scales it by the
    micro-batch's share of the mini-batch's total weight, so the step's gradient is
    that of the mean over the whole mini-batch however its rows are split into
    micro-batches (a token mean over every token of the mini-batch, a sequence mean
    over every row), equal micro-batches or token-budget bins of any row counts.
    Example: a token mean over rows of 1, 1, 3 and 3 tokens, losses 2, 2, 1, 1 per
    token, in two micro-batches of two rows: 2 x 2/8 + 1 x 6/8 = 1.25, the mini-batch's
    (4 + 6) / 8; a plain mean of the two micro-batch means would give 1.5."""

    fn: LossFn
    weights: RowWeights

    def __call__(self, outputs: torch.Tensor, batch: Batch
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return self.fn(outputs, batch)


def per_row(batch: Batch) -> torch.Tensor:
    """Weight 1 per row: a mean over rows (or over pairs of two rows each)."""
    return torch.ones(batch["tokens"].shape[0])


def loss_mask_of(batch: Batch) -> torch.Tensor:
    """The batch's ``loss_mask`` (SFT, rejection sampling)."""
    require(batch, "loss_mask")
    return batch["loss_mask"]


def aggregate_weights(mode: LossAgg, mask_of: Callable[[Batch], torch.Tensor]) -> RowWeights:
    """The row weights of :func:`aggregate` over ``mask_of(batch)``: ``token_mean``, the
    row's masked tokens; ``seq_mean_token_mean``, 1 for a row with any, else 0."""
    if mode not in ("token_mean", "seq_mean_token_mean"):
        raise ValueError(f"unknown loss aggregation {mode!r}")
    return partial(_aggregate_weights, mode=mode, mask_of=mask_of)   # picklable


def _aggregate_weights(batch: Batch, mode: LossAgg,
                       mask_of: Callable[[Batch], torch.Tensor]) -> torch.Tensor:
    tokens = mask_of(batch).sum(1)
    return tokens if mode == "token_mean" else (tokens > 0).to(tokens.dtype)


def loss_weights(loss: "LossFn | TrainLoss") -> RowWeights:
    """The row weights of a training loss: its own, or :func:`per_row` for a plain
    function (a mean over its micro-batch's rows)."""
    return loss.weights if isinstance(loss, TrainLoss) else per_row


def require(batch: Batch, *keys: str) -> None:
    """Raise :class:`UserError` naming the keys ``batch`` lacks."""
    missing = [k for k in keys if k not in batch]
    if missing:
        raise UserError(f"the batch lacks {', '.join(map(repr, missing))} "
                        f"(has {sorted(batch)})", field="batch")


def response_mask(lengths: torch.Tensor, prompt_lengths: torch.Tensor, s: int) -> torch.Tensor:
    """Float mask [b, s-1] of the log-prob positions that score response tokens.

    Position ``t`` predicts token ``t+1``; response tokens are ``prompt_len ..
    length-1``, so ``mask[i, t] = 1`` iff ``prompt_len[i] - 1 <= t < length[i] - 1``.
    Example: s=6, prompt_len=2, length=5 -> [0, 1, 1, 1, 0] (tokens 2, 3, 4).
    """
    t = torch.arange(s - 1, device=lengths.device).unsqueeze(0)
    mask = (t >= prompt_lengths.unsqueeze(1) - 1) & (t < lengths.unsqueeze(1) - 1)
    return mask.float()


def batch_mask(batch: Batch) -> torch.Tensor:
    """:func:`response_mask` of a batch (``tokens``, ``lengths``, ``prompt_lengths``),
    times its ``action_mask`` when it has one: a multi-turn rollout's [b, s-1] mask that
    is 0 on the positions scoring observation tokens (what an environment wrote is in
    the context but never in a loss, an advantage or a value target)."""
    require(batch, "tokens", "lengths", "prompt_lengths")
    mask = response_mask(batch["lengths"], batch["prompt_lengths"], batch["tokens"].shape[1])
    if "action_mask" in batch:
        mask = mask * batch["action_mask"].to(mask.dtype)
    return mask


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """sum(x * mask) / sum(mask) over ``dim`` (all entries when None); 0 where the
    mask is empty."""
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) with mean and (population) variance over the
    masked entries; zero outside the mask. Advantage normalisation (PPO, REINFORCE++)."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    return (x - mean) * torch.rsqrt(var + eps) * mask


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
               kind: KLEstimator = "k1") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman, "Approximating
    KL divergence", 2020), with log r = log pi_ref - log pi:

    - k1 = -log r (unbiased, high variance, can be negative);
    - k2 = (log r)^2 / 2 (biased, low variance);
    - k3 = "low_var_kl" = (r - 1) - log r (unbiased, low variance, >= 0).
    """
    log_r = ref_logprobs - logprobs
    if kind == "k1":
        return -log_r
    if kind == "k2":
        return 0.5 * log_r ** 2
    if kind in ("k3", "low_var_kl"):
        return torch.expm1(log_r) - log_r
    raise ValueError(f"unknown KL estimator {kind!r}; allowed: k1, k2, k3, low_var_kl")


def rollout_ref_logprobs(batch: Batch) -> torch.Tensor:
    """The reference's log-probs of the rollout tokens [b, s-1]. A run without a
    reference model (allowed only with a KL coefficient of 0; the graph then has no
    reference call) reads the rollout policy's own, so every KL estimate of the
    rollout is exactly 0 and the reward is unchanged."""
    return batch["ref_logprobs"] if "ref_logprobs" in batch else batch["logprobs"]


def token_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor,
             kind: KLEstimator = "k1") -> torch.Tensor:
    """Per-token KL estimate [b, s-1], zero outside ``mask``."""
    return kl_penalty(logprobs, ref_logprobs, kind) * mask


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: Aggregate) -> torch.Tensor:
    """Reduce a per-token loss to a scalar: ``token_mean`` averages over all response
    tokens of the micro-batch (over the mini-batch once the engine weighs it by
    :func:`aggregate_weights`); ``seq_mean_token_mean`` averages each sequence's tokens,
    then the sequences that have any (the GRPO paper's 1/G sum_i 1/|o_i| sum_t); a
    callable reduces as it says (DAPO's :func:`minibatch_token_mean`, Dr. GRPO's
    constant normaliser)."""
    if callable(mode):
        return mode(per_token, mask)
    if mode == "token_mean":
        return masked_mean(per_token, mask)
    if mode == "seq_mean_token_mean":
        has = (mask.sum(1) > 0).float()
        return masked_mean(masked_mean(per_token, mask, dim=1), has)
    raise ValueError(f"unknown loss aggregation {mode!r}")


def last_token_scores(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[b, s-1] with ``rewards[i]`` at each row's last masked position, zero elsewhere
    (and zero for a row with an empty mask)."""
    pos = torch.arange(mask.shape[1], device=mask.device)
    last = (mask * pos).argmax(dim=1, keepdim=True)
    out = torch.zeros_like(mask).scatter(1, last, rewards.to(mask.dtype).unsqueeze(1))
    return out * mask


def discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor,
                       gamma: float) -> torch.Tensor:
    """G_t = sum_{k>=t} gamma^(k-t) r_k over each row's response; zero outside ``mask``.
    ``k`` counts masked positions only: a multi-turn rollout's observation tokens
    between two model tokens are not time steps of the policy (no discount across
    them)."""
    rewards = token_rewards * mask
    out = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(mask[:, t] > 0, rewards[:, t] + gamma * running, running)
        out[:, t] = running
    return out * mask


def broadcast_to_tokens(seq_values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A per-sequence value [b] repeated over each row's masked positions [b, s-1]."""
    return seq_values.to(mask.dtype).unsqueeze(1) * mask


def group_view(x: torch.Tensor, group_size: int, what: str) -> torch.Tensor:
    """[b] -> [b / group_size, group_size]: consecutive rows sampled from one prompt."""
    if group_size < 1 or x.shape[0] % group_size:
        raise UserError(f"{x.shape[0]} rows do not split into groups of {group_size} "
                        f"samples per prompt", field=what)
    return x.reshape(-1, group_size)


def clipped_surrogate(logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                      advantages: torch.Tensor, mask: torch.Tensor, clip_ratio: float,
                      agg: Aggregate = "token_mean", clip_ratio_high: float | None = None
                      ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped objective (Schulman et al. 2017, eq. 7), as a loss:
    ratio = exp(log pi - log pi_old);
    L = -min(ratio * A, clip(ratio, 1-eps, 1+eps_high) * A), aggregated over ``mask``
    (``eps_high``: ``clip_ratio_high``, DAPO's clip-higher; None: ``clip_ratio``).
    Metrics: ``clip_frac`` (tokens where the clipped term was chosen), ``approx_kl``
    (mean of log pi_old - log pi), ``ratio`` (mean)."""
    high = clip_ratio if clip_ratio_high is None else clip_ratio_high
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -ratio * advantages
    clipped = -torch.clamp(ratio, 1 - clip_ratio, 1 + high) * advantages
    loss = aggregate(torch.max(unclipped, clipped), mask, agg)
    with torch.no_grad():
        metrics = {
            "clip_frac": masked_mean((clipped > unclipped).float(), mask),
            "approx_kl": masked_mean(old_logprobs - logprobs, mask),
            "ratio": masked_mean(ratio, mask),
        }
    return loss, metrics


def decoupled_surrogate(logprobs: torch.Tensor, prox_logprobs: torch.Tensor,
                        behaviour_logprobs: torch.Tensor, advantages: torch.Tensor,
                        mask: torch.Tensor, clip_ratio: float, weight_cap: float,
                        agg: Aggregate = "token_mean", clip_ratio_high: float | None = None
                        ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Decoupled PPO (Hilton et al. 2022, "Batch size-invariance for policy
    optimization"; AReaL's loss) for a rollout that an older policy generated:
    r = exp(log pi - log pi_prox), w = min(pi_prox / pi_behaviour, weight_cap) (no
    gradient), L = w * max(-r * A, -clip(r, 1-eps, 1+eps_high) * A), aggregated over
    ``mask`` (``eps_high`` as in :func:`clipped_surrogate`).

    Chosen over plain PPO with truncated importance sampling: the trust region stays
    around the current policy (``prox_logprobs``) instead of the stale behaviour policy,
    so staleness does not shrink the step (clipping against the behaviour log-probs
    would clip more tokens the staler the rollout: clip_frac grows), while the
    truncated weight ``w`` corrects for sampling from the behaviour policy. The price
    is one forward pass of the current policy over the batch, which the planner
    prices as its own call (``actor.prox_inference``).

    Metrics: those of :func:`clipped_surrogate` against the proximal policy
    (``clip_frac``, ``approx_kl``, ``ratio``), ``behave_weight`` (mean of the truncated
    ``w``) and ``behave_weight_capped_frac`` (tokens where the cap bit)."""
    with torch.no_grad():
        raw_weight = torch.exp(prox_logprobs - behaviour_logprobs)
        weight = torch.clamp(raw_weight, max=weight_cap)
    high = clip_ratio if clip_ratio_high is None else clip_ratio_high
    ratio = torch.exp(logprobs - prox_logprobs)
    unclipped = -ratio * advantages
    clipped = -torch.clamp(ratio, 1 - clip_ratio, 1 + high) * advantages
    loss = aggregate(weight * torch.max(unclipped, clipped), mask, agg)
    with torch.no_grad():
        metrics = {
            "clip_frac": masked_mean((clipped > unclipped).float(), mask),
            "approx_kl": masked_mean(prox_logprobs - logprobs, mask),
            "ratio": masked_mean(ratio, mask),
            "behave_weight": masked_mean(weight, mask),
            "behave_weight_capped_frac": masked_mean((raw_weight > weight_cap).float(), mask),
        }
    return loss, metrics


def policy_surrogate(logprobs_new: torch.Tensor, batch: Batch, clip_ratio: float,
                     agg: Aggregate, weight_cap: float, clip_ratio_high: float | None = None,
                     mask: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The policy loss of a batch: :func:`decoupled_surrogate` when an asynchronous
    rollout brings ``prox_logprobs`` (the current policy's, scored before this step's
    update), else :func:`clipped_surrogate` against the rollout's ``logprobs``, over
    ``mask`` (None: the response tokens)."""
    mask = batch_mask(batch) if mask is None else mask
    if "prox_logprobs" in batch:
        return decoupled_surrogate(logprobs_new, batch["prox_logprobs"], batch["logprobs"],
                                   batch["advantages"], mask, clip_ratio, weight_cap, agg,
                                   clip_ratio_high)
    return clipped_surrogate(logprobs_new, batch["logprobs"], batch["advantages"], mask,
                             clip_ratio, agg, clip_ratio_high)


def clip_sides(ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
               clip_ratio: float, clip_ratio_high: float) -> dict[str, torch.Tensor]:
    """Where each side of the clip binds, as shares of ``mask``: ``clip_frac_low`` (ratio
    below 1 - clip_ratio with a negative advantage: the update may not lower the
    probability further) and ``clip_frac_high`` (ratio above 1 + clip_ratio_high with a
    positive advantage). Example: ratios 0.7, 1.3, 1.3 with advantages -1, 1, -1 and
    clips 0.2 / 0.28 -> low 1/3, high 1/3 (the third is not clipped: its advantage
    lowers a grown ratio)."""
    with torch.no_grad():
        low = (ratio < 1 - clip_ratio) & (advantages < 0)
        high = (ratio > 1 + clip_ratio_high) & (advantages > 0)
        return {"clip_frac_low": masked_mean(low.float(), mask),
                "clip_frac_high": masked_mean(high.float(), mask)}


def sequence_logprob(logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log pi(response | prompt) = sum of the response tokens' log-probs, [b]."""
    return (logprobs * mask).sum(1)


def pairs(x: torch.Tensor, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Split interleaved rows (2i chosen, 2i+1 rejected) into (chosen, rejected)."""
    if x.shape[0] % 2:
        raise UserError(f"preference pairs need an even number of rows (chosen, rejected "
                        f"interleaved), got {x.shape[0]}", field=what)
    return x[0::2], x[1::2]


def surrogate_actor_loss(logprobs_new: torch.Tensor, batch: Batch, cfg
                         ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`policy_surrogate` over the response tokens (token mean) with
    ``cfg.clip_ratio`` and ``cfg.importance_cap`` (ReMax, RLOO, REINFORCE++ put their
    KL in the reward, so this is their whole loss). Metrics: clip_frac, approx_kl,
    ratio (+ behave_weight, behave_weight_capped_frac with ``prox_logprobs``)."""
    return policy_surrogate(logprobs_new, batch, cfg.clip_ratio, "token_mean",
                            cfg.importance_cap)


# ---- the train call's mini-batches -------------------------------------------------

def minibatch(batch: Batch, index: int, n_minibatches: int) -> Batch:
    """The ``index``-th of ``n_minibatches`` equal row slices of a prepared batch (what
    one optimizer step trains on). When the batch carries a ``loss_mask`` (the tokens
    its loss counts), every row is also given the mini-batch's totals, for a loss that
    averages over the whole mini-batch rather than over each micro-batch
    (:func:`minibatch_token_mean`): ``minibatch_rows`` and ``minibatch_tokens`` (the
    sum of its ``loss_mask``). Per-row values are [rows], so they split with the rows
    over data-parallel ranks and micro-batches."""
    rows = batch["tokens"].shape[0]
    size = rows // n_minibatches
    sl = slice(index * size, (index + 1) * size)
    sub = {k: (v[sl] if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == rows
               else v) for k, v in batch.items()}
    if "loss_mask" in sub:
        tokens = float(sub["loss_mask"].sum())
        sub["minibatch_rows"] = torch.full((size,), float(size))
        sub["minibatch_tokens"] = torch.full((size,), tokens)
    return sub


def minibatch_token_mean(per_token: torch.Tensor, mask: torch.Tensor, batch: Batch
                         ) -> torch.Tensor:
    """A micro-batch's share of the mean over every masked token of its mini-batch:
    sum(per_token * mask) * (minibatch_rows / rows here) / minibatch_tokens.

    Its weights are :func:`per_row`: the train engine weighs each micro-batch by its
    share of the mini-batch's rows, so the weighted sum over micro-batches of any row
    counts (equal ones, or token-budget bins) is exactly sum over the mini-batch / its
    token count (DAPO's token-level loss). Example: a mini-batch of 4 rows with 1, 1, 3, 3 tokens in 2
    micro-batches, loss 2 on each token of the first and 1 on each of the second: its
    token mean is (2 * 2 + 6 * 1) / 8 = 1.25; this gives 4 * 2 / 8 = 1 and 6 * 2 / 8 =
    1.5, mean 1.25, where token means per micro-batch give (2 + 1) / 2 = 1.5."""
    require(batch, "minibatch_rows", "minibatch_tokens")
    parts = batch["minibatch_rows"][0] / per_token.shape[0]
    return (per_token * mask).sum() * parts / batch["minibatch_tokens"][0].clamp(min=1)


def with_stats(batch: Batch, **stats: float) -> Batch:
    """``batch`` with statistics of its preparation for the train call's metrics
    (``actor.<name>``), under :data:`STAT_PREFIX` keys (taken out again by
    :func:`pop_stats` before anything trains)."""
    return {**batch, **{STAT_PREFIX + k: torch.tensor(float(v)) for k, v in stats.items()}}


def pop_stats(batch: Batch) -> tuple[Batch, dict[str, float]]:
    """(the batch without its statistics, the statistics by name) (:func:`with_stats`)."""
    stats = {k.removeprefix(STAT_PREFIX): float(v) for k, v in batch.items()
             if k.startswith(STAT_PREFIX)}
    return {k: v for k, v in batch.items() if not k.startswith(STAT_PREFIX)}, stats
