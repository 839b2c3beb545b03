"""PPO against hand-computed values: KL-penalised token rewards, GAE, the prepared
batch, the actor loss (with the KL as a loss) and the clipped value loss."""
from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from realign.algorithms import ppo
from realign.algorithms.common import masked_mean

pytestmark = pytest.mark.torch

LN2 = math.log(2)


def t(x):
    return torch.tensor(x, dtype=torch.float32)


def test_config_defaults_and_extra_keys_forbidden():
    cfg = ppo.PPOConfig()
    assert (cfg.gamma, cfg.lam, cfg.clip_ratio, cfg.kl_in_reward) == (1.0, 0.95, 0.2, True)
    with pytest.raises(ValidationError, match="extra"):
        ppo.PPOConfig(gama=0.9)
    with pytest.raises(ValidationError):
        ppo.PPOConfig(lam=1.5)


def test_token_rewards_kl_on_response_and_score_on_last_token():
    # s=5, prompt 2, length 5 -> response positions 1, 2, 3
    mask = t([[0, 1, 1, 1]])
    lp = t([[-5.0, -1.0, -1.0, -1.0]])
    ref = t([[-1.0, -1.1, -1.2, -1.3]])        # log pi - log ref = 0.1, 0.2, 0.3
    r = ppo.token_rewards(t([1.0]), lp, ref, mask, kl_coef=0.5)
    assert r.tolist() == [[0.0, pytest.approx(-0.05), pytest.approx(-0.1),
                           pytest.approx(1 - 0.15)]]


def test_gae_by_hand_gamma_half_lambda_half():
    # positions: 0 = prompt, 1..3 = response, 4 = padding. Rewards 0, 0, 1 on the
    # response; V = 0.5 everywhere on it; garbage (9) on masked positions must not
    # matter, and the state after the last response token is terminal (value 0).
    mask = t([[0, 1, 1, 1, 0]])
    r = t([[9, 0, 0, 1, 9]])
    v = t([[9, 0.5, 0.5, 0.5, 9]])
    adv, ret = ppo.gae(r, v, mask, gamma=0.5, lam=0.5)
    # delta3 = 1 - 0.5 = 0.5;               A3 = 0.5
    # delta2 = 0 + 0.5*0.5 - 0.5 = -0.25;   A2 = -0.25 + 0.25*0.5 = -0.125
    # delta1 = -0.25;                       A1 = -0.25 + 0.25*(-0.125) = -0.28125
    assert adv.tolist() == [[0, -0.28125, -0.125, 0.5, 0]]
    assert ret.tolist() == [[0, 0.21875, 0.375, 1.0, 0]]


def test_gae_with_lambda_one_is_monte_carlo_return_minus_value():
    mask = t([[1, 1, 1], [1, 1, 0]])
    r = t([[1, 2, 3], [4, 5, 0]])
    v = t([[1, 1, 1], [2, 3, 7]])
    adv, ret = ppo.gae(r, v, mask, gamma=1.0, lam=1.0)
    assert ret.tolist() == [[6, 5, 3], [9, 5, 0]]
    assert adv.tolist() == [[5, 4, 2], [7, 2, 0]]


def _rollout():
    # two sequences, s = 5: row 0 prompt 2 length 5 (response positions 1..3),
    # row 1 prompt 3 length 4 (response position 2 only)
    return {
        "tokens": torch.zeros(2, 5, dtype=torch.long),
        "lengths": torch.tensor([5, 4]),
        "prompt_lengths": torch.tensor([2, 3]),
        "rewards": t([1.0, 2.0]),
        "logprobs": t([[-1, -1, -1, -1], [-1, -1, -1, -1]]),
        "ref_logprobs": t([[-1, -1.5, -1, -1], [-1, -1, -2, -1]]),
        "values": t([[7, 0.5, 0.5, 0.5, 7], [7, 7, 1.0, 7, 0]]),
    }


def test_prepare_adds_gae_advantages_and_returns():
    cfg = ppo.PPOConfig(gamma=0.5, lam=0.5, kl_coef=0.1, normalize_advantages=False)
    out = ppo.prepare(_rollout(), cfg)
    # row 0 rewards: -0.1*0.5 = -0.05, 0, 1 -> deltas -0.05+0.25-0.5 = -0.3, -0.25, 0.5
    # A3 = 0.5, A2 = -0.125, A1 = -0.3 + 0.25*(-0.125) = -0.33125
    # row 1: reward 2 - 0.1*1 = 1.9 at position 2; A = 1.9 - 1.0 = 0.9
    assert out["advantages"].tolist() == [[0, pytest.approx(-0.33125), -0.125, 0.5],
                                          [0, 0, pytest.approx(0.9), 0]]
    assert out["returns"].tolist() == [[0, pytest.approx(0.16875), 0.375, 1.0],
                                       [0, 0, pytest.approx(1.9), 0]]
    assert set(out) == set(_rollout()) | {"advantages", "returns"}


def test_prepare_whitens_advantages_over_response_tokens():
    out = ppo.prepare(_rollout(), ppo.PPOConfig())
    mask = t([[0, 1, 1, 1], [0, 0, 1, 0]])
    adv = out["advantages"]
    assert masked_mean(adv, mask).item() == pytest.approx(0, abs=1e-6)
    assert masked_mean(adv ** 2, mask).item() == pytest.approx(1, abs=1e-5)
    assert (adv * (1 - mask)).abs().sum() == 0


def test_prepare_without_kl_in_reward_ignores_the_reference():
    cfg = ppo.PPOConfig(gamma=1, lam=1, kl_in_reward=False, normalize_advantages=False)
    out = ppo.prepare(_rollout(), cfg)
    assert out["returns"].tolist() == [[0, 1, 1, 1], [0, 0, 2, 0]]


def test_actor_loss_adds_k3_kl_when_not_in_reward():
    batch = {
        "tokens": torch.zeros(2, 3, dtype=torch.long), "lengths": torch.tensor([3, 3]),
        "prompt_lengths": torch.tensor([1, 2]),
        "logprobs": torch.zeros(2, 2), "advantages": t([[1, -1], [0, 3]]),
        "ref_logprobs": torch.full((2, 2), LN2),          # log(ref/pi) = ln 2
    }
    new = torch.zeros(2, 2)                                 # ratio 1
    cfg = ppo.PPOConfig(kl_in_reward=False, kl_coef=0.5, kl_estimator="k3")
    loss, m = ppo.actor_loss(new, batch, cfg)
    # surrogate: tokens (0,0), (0,1), (1,1) -> mean(-1, 1, -3) = -1; k3 = 2 - 1 - ln 2
    assert loss.item() == pytest.approx(-1 + 0.5 * (1 - LN2))
    assert m["kl"].item() == pytest.approx(-LN2)
    loss_r, _ = ppo.actor_loss(new, batch, ppo.PPOConfig(kl_coef=0.5))
    assert loss_r.item() == pytest.approx(-1)


def test_critic_loss_clipped_by_hand():
    # three sequences with one response token each (position 0 of the [b, s-1] grid);
    # old value 0, return 1, clip 0.2
    batch = {
        "tokens": torch.zeros(3, 3, dtype=torch.long), "lengths": torch.tensor([2, 2, 2]),
        "prompt_lengths": torch.tensor([1, 1, 1]),
        "values": torch.zeros(3, 3), "returns": t([[1, 0], [1, 0], [1, 0]]),
    }
    values_new = t([[0.5, 9, 0], [1.0, 9, 0], [0.1, 9, 0]])
    loss, m = ppo.critic_loss(values_new, batch, ppo.PPOConfig(value_clip=0.2))
    # V=0.5: max(0.25, (0.2-1)^2=0.64) = 0.64; V=1: max(0, 0.64) = 0.64;
    # V=0.1: max(0.81, 0.81) = 0.81   -> 0.5 * mean = 0.5 * 2.09 / 3
    assert loss.item() == pytest.approx(0.5 * (0.64 + 0.64 + 0.81) / 3)
    assert m["value_clip_frac"].item() == pytest.approx(2 / 3)
    assert m["value"].item() == pytest.approx(1.6 / 3)


def test_losses_decrease_along_negative_gradient():
    cfg = ppo.PPOConfig(kl_in_reward=False, kl_coef=0.1)
    batch = ppo.prepare(_rollout(), cfg)
    theta = torch.zeros(2, 4, requires_grad=True)
    actor = ppo.actor_loss_fn(cfg)
    loss, _ = actor(batch["logprobs"] + theta, batch)
    loss.backward()
    with torch.no_grad():
        after, _ = actor(batch["logprobs"] + theta - 0.01 * theta.grad, batch)
    assert after < loss
    # tokens with positive advantage are made more likely
    adv = batch["advantages"]
    assert (theta.grad[adv > 0] < 0).all() and (theta.grad[adv < 0] > 0).all()

    v = batch["values"].clone().requires_grad_(True)
    critic = ppo.critic_loss_fn(cfg)
    c, _ = critic(v, batch)
    c.backward()
    with torch.no_grad():
        c_after, _ = critic(v - 0.01 * v.grad, batch)
    assert c_after < c


def test_without_a_reference_model_prepare_and_loss_equal_kl_coef_zero():
    """No ref_logprobs (a run without a reference model): the KL in the reward is 0, so
    advantages and returns are those at kl_coef 0; the loss reports no KL."""
    full = _rollout()
    without = {k: v for k, v in full.items() if k != "ref_logprobs"}
    cfg = ppo.PPOConfig(gamma=0.5, lam=0.5, kl_coef=0.0, normalize_advantages=False)
    a, b = ppo.prepare(full, cfg), ppo.prepare(without, cfg)
    for key in ("advantages", "returns"):
        torch.testing.assert_close(a[key], b[key])
    # row 1: reward 2 at position 2 with no KL -> advantage 2 - value 1.0
    assert b["advantages"][1].tolist() == [0, 0, 1.0, 0]
    loss_a, _ = ppo.actor_loss(full["logprobs"] + 0.1, a, cfg)
    loss_b, m = ppo.actor_loss(full["logprobs"] + 0.1, b, cfg)
    torch.testing.assert_close(loss_a, loss_b)
    assert "kl" not in m
