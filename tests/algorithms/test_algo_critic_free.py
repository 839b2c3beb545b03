"""GRPO, RLOO, ReMax and REINFORCE++ advantages and losses against hand-computed
values."""
from __future__ import annotations

import math

import pytest
import torch

from realign.algorithms import grpo, reinforce_pp, remax, rloo
from realign.algorithms.common import response_mask
from realign.errors import UserError

pytestmark = pytest.mark.torch

LN2 = math.log(2)


def t(x):
    return torch.tensor(x, dtype=torch.float32)


def close(actual, expected):
    torch.testing.assert_close(actual, t(expected), atol=1e-5, rtol=0)


def _batch(rewards, lengths, prompt_lengths, s=5, **extra):
    b = len(rewards)
    return {"tokens": torch.zeros(b, s, dtype=torch.long), "lengths": torch.tensor(lengths),
            "prompt_lengths": torch.tensor(prompt_lengths), "rewards": t(rewards),
            "logprobs": torch.zeros(b, s - 1), "ref_logprobs": torch.zeros(b, s - 1), **extra}


# ---- GRPO -------------------------------------------------------------------------

def test_grpo_group_normalisation_by_hand():
    # group 1: 0, 2, 4 -> mean 2, unbiased std 2 -> -1, 0, 1; group 2: constant -> 0
    adv = grpo.group_advantages(t([0, 2, 4, 5, 5, 5]), 3, eps=1e-12)
    assert adv.tolist() == [pytest.approx(-1), 0, pytest.approx(1), 0, 0, 0]


def test_grpo_groups_are_consecutive_rows_and_must_divide_the_batch():
    adv = grpo.group_advantages(t([0, 2, 10, 30]), 2)
    # groups (0, 2) and (10, 30): +-1/sqrt(2) scaled by std sqrt(2) and 10 sqrt(2)
    s = 1 / math.sqrt(2)
    assert adv.tolist() == pytest.approx([-s, s, -s, s], abs=1e-5)
    with pytest.raises(UserError, match="groups of 4"):
        grpo.group_advantages(t([0, 1, 2, 3, 4, 5]), 4)


def test_grpo_prepare_broadcasts_over_response_tokens_only():
    b = _batch([0, 2, 4], lengths=[5, 4, 3], prompt_lengths=[2, 2, 2])
    out = grpo.prepare(b, grpo.GRPOConfig(samples_per_prompt=3))
    close(out["advantages"], [[0, -1, -1, -1], [0, 0, 0, 0], [0, 1, 0, 0]])


def test_grpo_loss_sequence_mean_and_k3_kl_by_hand():
    # row 0: one response token with A = 2; row 1: three tokens with A = -1; ratio 1
    batch = _batch([0, 0], lengths=[3, 5], prompt_lengths=[2, 2],
                   advantages=t([[0, 2, 0, 0], [0, -1, -1, -1]]))
    batch["ref_logprobs"] = torch.full((2, 4), LN2)      # k3 = 1 - ln 2 per token
    new = torch.zeros(2, 4)
    cfg = grpo.GRPOConfig(samples_per_prompt=2, kl_coef=0.1)
    loss, m = grpo.actor_loss(new, batch, cfg)
    # per-sequence means -2 and 1 -> -0.5
    assert loss.item() == pytest.approx(-0.5 + 0.1 * (1 - LN2))
    assert m["kl"].item() == pytest.approx(1 - LN2)
    tok = grpo.GRPOConfig(samples_per_prompt=2, kl_coef=0.0, loss_agg="token_mean")
    assert grpo.actor_loss(new, batch, tok)[0].item() == pytest.approx((-2 + 3) / 4)


# ---- RLOO -------------------------------------------------------------------------

def test_rloo_leave_one_out_by_hand():
    # k = 4, rewards 1, 2, 3, 6: baselines 11/3, 10/3, 3, 2
    adv = rloo.leave_one_out_advantages(t([1, 2, 3, 6]), 4)
    assert adv.tolist() == pytest.approx([-8 / 3, -4 / 3, 0, 4])
    # k = 2, two groups: (1, 3) -> -2, 2; (5, 5) -> 0, 0
    assert rloo.leave_one_out_advantages(t([1, 3, 5, 5]), 2).tolist() == [-2, 2, 0, 0]


def test_rloo_prepare_subtracts_sequence_kl_from_the_reward():
    # row 0: two response tokens with log pi - log ref = 0.5 -> KL sum 1; row 1: none
    b = _batch([3, 1], lengths=[4, 4], prompt_lengths=[2, 2])
    b["logprobs"] = t([[0, 0.5, 0.5, 0], [0, 0, 0, 0]])
    out = rloo.prepare(b, rloo.RLOOConfig(samples_per_prompt=2, kl_coef=1.0))
    # rewards 3 - 1 = 2 and 1 -> advantages 1, -1 on positions 1, 2
    assert out["advantages"].tolist() == [[0, 1, 1, 0], [0, -1, -1, 0]]


# ---- ReMax ------------------------------------------------------------------------

def test_remax_greedy_baseline_per_prompt_and_per_sample():
    r = t([3, 1, 2, 2])
    assert remax.greedy_baseline_advantages(r, t([2, 1]), 2).tolist() == [1, -1, 1, 1]
    assert remax.greedy_baseline_advantages(r, t([1, 1, 1, 1]), 2).tolist() == [2, 0, 1, 1]
    with pytest.raises(UserError, match="greedy_rewards has 3 rows"):
        remax.greedy_baseline_advantages(r, t([1, 2, 3]), 2)


def test_remax_prepare_consumes_greedy_rewards():
    b = _batch([3, 0], lengths=[4, 5], prompt_lengths=[3, 2], greedy_rewards=t([1, 1]))
    out = remax.prepare(b, remax.ReMaxConfig(samples_per_prompt=1, kl_coef=0.0))
    assert "greedy_rewards" not in out
    assert out["advantages"].tolist() == [[0, 0, 2, 0], [0, -1, -1, -1]]


# ---- REINFORCE++ ------------------------------------------------------------------

def test_reinforce_pp_discounted_return_and_batch_whitening():
    # row 0: 3 response tokens, score 4, gamma 0.5 -> returns 1, 2, 4
    b = _batch([4], lengths=[5], prompt_lengths=[2])
    out = reinforce_pp.prepare(b, reinforce_pp.ReinforcePPConfig(gamma=0.5, kl_coef=0.0))
    assert out["returns"].tolist() == [[0, 1, 2, 4]]
    # whitened over the batch's response tokens: mean 7/3
    g = t([1, 2, 4])
    assert out["advantages"][0, 1:].tolist() == pytest.approx(
        ((g - g.mean()) / g.std(unbiased=False)).tolist(), abs=1e-5)
    # gamma 1: each row's return is its score on every token; two rows -> +-1
    b2 = _batch([1, 3], lengths=[4, 4], prompt_lengths=[2, 2])
    out2 = reinforce_pp.prepare(b2, reinforce_pp.ReinforcePPConfig(kl_coef=0.0))
    close(out2["advantages"], [[0, -1, -1, 0], [0, 1, 1, 0]])


def test_reinforce_pp_token_kl_penalty_enters_the_return():
    b = _batch([1], lengths=[4], prompt_lengths=[2])
    b["logprobs"] = t([[0, 1.0, 0, 0]])     # KL_k1 = 1 at position 1
    out = reinforce_pp.prepare(b, reinforce_pp.ReinforcePPConfig(kl_coef=0.5))
    assert out["returns"].tolist() == [[0, 0.5, 1, 0]]


# ---- all four: gradient direction --------------------------------------------------

@pytest.mark.parametrize("mod,cfg,extra", [
    (grpo, grpo.GRPOConfig(samples_per_prompt=2), {}),
    (rloo, rloo.RLOOConfig(samples_per_prompt=2), {}),
    (remax, remax.ReMaxConfig(samples_per_prompt=2), {"greedy_rewards": t([0.5, 1.0])}),
    (reinforce_pp, reinforce_pp.ReinforcePPConfig(), {}),
])
def test_loss_decreases_along_negative_gradient(mod, cfg, extra):
    b = _batch([1, 0, 0, 2], lengths=[5, 4, 5, 3], prompt_lengths=[2, 2, 3, 1], **extra)
    b["logprobs"] = -torch.rand(4, 4, generator=torch.Generator().manual_seed(0))
    batch = mod.prepare(b, cfg)
    loss_fn = mod.actor_loss_fn(cfg)
    theta = torch.zeros(4, 4, requires_grad=True)
    loss, metrics = loss_fn(batch["logprobs"] + theta, batch)
    assert loss.dim() == 0 and all(v.dim() == 0 for v in metrics.values())
    loss.backward()
    with torch.no_grad():
        after, _ = loss_fn(batch["logprobs"] + theta - 0.01 * theta.grad, batch)
    assert after < loss
    adv = batch["advantages"]
    assert (theta.grad[adv > 0] < 0).all() and (theta.grad[adv < 0] > 0).all()
    mask = response_mask(batch["lengths"], batch["prompt_lengths"], 5)
    assert (theta.grad[mask == 0] == 0).all()       # prompt and padding get no gradient


# ---- no reference model (kl_coef 0) ------------------------------------------------

@pytest.mark.parametrize("mod,cfg,extra", [
    (grpo, grpo.GRPOConfig(samples_per_prompt=2, kl_coef=0.0), {}),
    (rloo, rloo.RLOOConfig(samples_per_prompt=2, kl_coef=0.0), {}),
    (reinforce_pp, reinforce_pp.ReinforcePPConfig(kl_coef=0.0), {}),
    (remax, remax.ReMaxConfig(samples_per_prompt=2, kl_coef=0.0),
     {"greedy_rewards": t([1.0])}),
])
def test_without_ref_logprobs_the_advantages_and_loss_are_those_of_kl_coef_zero(mod, cfg, extra):
    """A run without a reference model has no ref_logprobs: the advantages and the loss
    equal those with a reference at kl_coef 0 (which weighs the KL by nothing)."""
    with_ref = _batch([3, 1], lengths=[4, 5], prompt_lengths=[2, 3], **extra)
    with_ref["ref_logprobs"] = t([[0, -0.7, 0.3, 0], [0, 0, 0.2, -0.4]])
    with_ref["logprobs"] = t([[0, -0.2, -0.1, 0], [0, 0, -0.3, -0.5]])
    without = {k: v for k, v in with_ref.items() if k != "ref_logprobs"}
    a, b = mod.prepare(with_ref, cfg), mod.prepare(without, cfg)
    assert "ref_logprobs" not in b
    torch.testing.assert_close(a["advantages"], b["advantages"])
    new = with_ref["logprobs"] + 0.1
    loss_a, m_a = mod.actor_loss(new, a, cfg)
    loss_b, m_b = mod.actor_loss(new, b, cfg)
    torch.testing.assert_close(loss_a, loss_b)
    assert "kl" not in m_b
