"""The rollout's log-probs against the training forward's: how far the engine that
generated (realign's own, or vLLM) is from the one that trains.

Where the actor's training forward scored the rollout before its update
(``prox_logprobs``: ``actor.prox_inference``, in every graph that may generate on
vLLM, with ``tis_cap``, and in asynchronous ones), the train call reports, over every
response token of the batch, ``d = |log pi_train - log pi_rollout|``:
``rollout_logprob_diff_mean``, ``_max`` and ``_frac`` (the share of tokens with ``d``
above ``rollout.logprob_diff_threshold``). Asynchronous rollouts also differ by the
policy versions between them; the metrics then measure both.
"""
from __future__ import annotations

from realign.algorithms.common import Batch, batch_mask


def rollout_mismatch(batch: Batch, threshold: float) -> dict[str, float]:
    """The mismatch metrics of ``batch`` (empty without ``prox_logprobs``).

    Example: differences 0, 0.02 and 0.5 on three response tokens, threshold 0.01:
    mean 0.1733, max 0.5, frac 2/3."""
    if "prox_logprobs" not in batch or "logprobs" not in batch:
        return {}
    mask = batch_mask(batch).bool()
    d = (batch["prox_logprobs"].double() - batch["logprobs"].double()).abs()[mask]
    if d.numel() == 0:
        return {}
    return {"rollout_logprob_diff_mean": float(d.mean()),
            "rollout_logprob_diff_max": float(d.max()),
            "rollout_logprob_diff_frac": float((d > threshold).double().mean())}
