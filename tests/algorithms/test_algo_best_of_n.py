"""Rejection sampling (best-of-N SFT) and online DPO (best against worst) against
hand-computed values: which rows each keeps, the weights of what it cannot drop (a
weak best, a tie) and the losses."""
from __future__ import annotations

import math

import pytest
import torch

from realign.algorithms import online_dpo, rejection_sampling
from realign.algorithms.common import pop_stats
from realign.algorithms.params import OnlineDPOConfig, RejectionSamplingConfig
from realign.algorithms.selection import best_and_worst, best_in_groups, constant_groups
from realign.errors import UserError

pytestmark = pytest.mark.torch


def t(x):
    return torch.tensor(x, dtype=torch.float32)


def softplus(x):
    return math.log1p(math.exp(x))          # -log sigma(-x)


def _rollout(rewards, s=5):
    """Rows of 2 prompt and 2 response tokens (positions 1, 2); row i's log-probs are
    -(i + 1) on its response positions and garbage (-9) elsewhere."""
    b = len(rewards)
    lp = torch.full((b, s - 1), -9.0)
    lp[:, 1:3] = -(torch.arange(b, dtype=torch.float32) + 1).unsqueeze(1)
    return {"tokens": torch.arange(b).unsqueeze(1).repeat(1, s), "lengths": torch.full((b,), 4),
            "prompt_lengths": torch.full((b,), 2), "rewards": t(rewards), "logprobs": lp,
            "ref_logprobs": torch.zeros(b, s - 1), "policy_version": torch.zeros(b, dtype=torch.long)}


def test_selection_examples():
    assert best_in_groups(t([0.2, 0.9, 0.9, 0.5, 0.1, 0.3]), 3, "g").tolist() == [1, 3]
    best, worst = best_and_worst(t([1, 0, 1, 0, 0.5, 0.5, 0.5, 0.5]), 4, "g")
    assert (best.tolist(), worst.tolist()) == ([0, 4], [3, 7])
    assert constant_groups(t([1, 1, 0, 1, 0, 0, 0, 0]), 4, "g").tolist() == [False, True]


# ---- rejection sampling --------------------------------------------------------------

def test_rejection_sampling_keeps_each_prompts_best():
    raw = _rollout([0.1, 0.7, 0.3, 0.0, 0.0, 0.2])         # 2 prompts x N = 3
    out, stats = pop_stats(rejection_sampling.prepare(
        raw, RejectionSamplingConfig(samples_per_prompt=3)))
    assert out["tokens"][:, 0].tolist() == [1, 5]              # rows 1 and 5
    assert out["loss_mask"].tolist() == [[0, 1, 1, 0]] * 2
    assert stats == pytest.approx({"kept_frac": 2 / 6, "best_reward_mean": 0.45})
    # NLL over the kept rows' response tokens: rows 1 and 5 have log-probs -2 and -6
    loss, m = rejection_sampling.actor_loss(out["logprobs"], out,
                                            RejectionSamplingConfig(samples_per_prompt=3))
    assert loss.item() == pytest.approx((2 + 2 + 6 + 6) / 4)
    assert m["tokens"].item() == 4


def test_rejection_sampling_threshold_weighs_a_weak_best_zero():
    raw = _rollout([0.1, 0.7, 0.3, 0.0, 0.0, 0.2])
    c = RejectionSamplingConfig(samples_per_prompt=3, min_reward=0.5)
    out, stats = pop_stats(rejection_sampling.prepare(raw, c))
    assert out["tokens"].shape[0] == 2                         # still one row per prompt
    assert out["loss_mask"].sum(1).tolist() == [2, 0]
    assert stats["kept_frac"] == pytest.approx(1 / 6)
    loss, _ = rejection_sampling.actor_loss(out["logprobs"], out, c)
    assert loss.item() == pytest.approx(2.0)                   # row 1 alone


# ---- online DPO ----------------------------------------------------------------------

def test_online_dpo_pairs_the_best_with_the_worst():
    # prompt 0: rewards 0, 1, 1, 0 -> chosen row 1 (first best), rejected row 3 (last
    # worst); prompt 1: all 0.5 -> a tie, rows 4 and 7, weight 0
    raw = _rollout([0, 1, 1, 0, 0.5, 0.5, 0.5, 0.5])
    out, stats = pop_stats(online_dpo.prepare(raw, OnlineDPOConfig(samples_per_prompt=4)))
    assert out["tokens"][:, 0].tolist() == [1, 3, 4, 7]
    assert out["pair_weight"].tolist() == [1, 1, 0, 0]
    assert stats == pytest.approx({"tied_pair_frac": 0.5, "score_margin": 0.5})


def test_online_dpo_loss_by_hand():
    raw = _rollout([0, 1, 1, 0, 0.5, 0.5, 0.5, 0.5])
    c = OnlineDPOConfig(samples_per_prompt=4, beta=0.25)
    batch, _ = pop_stats(online_dpo.prepare(raw, c))
    # log pi - log ref over 2 response tokens (ref 0): rows 1, 3, 4, 7 -> -4, -8, -10, -16
    # pair 0: h = -4 - (-8) = 4, beta h = 1 -> log(1 + e^-1); pair 1 (tie) weighs 0 but
    # counts in the mean over the step's pairs
    loss, m = online_dpo.actor_loss(batch["logprobs"], batch, c)
    assert loss.item() == pytest.approx(softplus(-1) / 2)
    # implicit rewards over the untied pair only
    assert m["reward_margin"].item() == pytest.approx(1.0)
    assert m["reward_chosen"].item() == pytest.approx(-1.0)
    assert m["reward_accuracy"].item() == 1.0


def test_online_dpo_needs_the_reference():
    raw = _rollout([0, 1, 1, 0])
    raw.pop("ref_logprobs")
    with pytest.raises(UserError, match="ref_logprobs"):
        online_dpo.prepare(raw, OnlineDPOConfig(samples_per_prompt=2))
