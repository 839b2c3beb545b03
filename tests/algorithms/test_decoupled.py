"""The decoupled PPO loss of asynchronous rollouts (behaviour, proximal and new policy)
against hand-computed values, its reduction to the clipped surrogate when the rollout
is on-policy, its gradient, and its use by every actor loss."""
from __future__ import annotations

import math
from functools import partial

import pytest
import torch
from pydantic import ValidationError

from realign.algorithms import grpo, ppo, reinforce_pp, remax, rloo
from realign.algorithms.common import (
    clipped_surrogate,
    decoupled_surrogate,
    policy_surrogate,
    response_mask,
)

pytestmark = pytest.mark.torch

AGGS = ["token_mean", "seq_mean_token_mean"]


def t(x):
    return torch.tensor(x, dtype=torch.float32)


def _random(seed=0, b=3, n=6):
    g = torch.Generator().manual_seed(seed)
    behaviour = -torch.rand(b, n, generator=g) * 3
    prox = behaviour + torch.randn(b, n, generator=g)
    new = prox + 0.3 * torch.randn(b, n, generator=g)
    adv = torch.randn(b, n, generator=g)
    mask = response_mask(torch.tensor([7, 5, 6]), torch.tensor([2, 1, 3]), n + 1)
    return behaviour, prox, new, adv, mask


# ---- (a) on-policy: the clipped surrogate, bit for bit ------------------------------

@pytest.mark.parametrize("agg", AGGS)
def test_prox_equal_to_behaviour_is_the_clipped_surrogate_exactly(agg):
    behaviour, _, new, adv, mask = _random()
    x1, x2 = new.clone().requires_grad_(), new.clone().requires_grad_()
    loss_c, m_c = clipped_surrogate(x1, behaviour, adv, mask, 0.2, agg)
    loss_d, m_d = decoupled_surrogate(x2, behaviour.clone(), behaviour, adv, mask, 0.2, 5.0,
                                      agg)
    loss_c.backward()
    loss_d.backward()
    assert torch.equal(loss_c, loss_d)
    assert torch.equal(x1.grad, x2.grad)
    for key in m_c:
        assert torch.equal(m_c[key], m_d[key]), key
    assert m_d["behave_weight"].item() == 1.0
    assert m_d["behave_weight_capped_frac"].item() == 0.0


def test_policy_surrogate_without_prox_is_the_clipped_surrogate():
    behaviour, prox, new, adv, _ = _random()
    batch = {"tokens": torch.zeros(3, 7, dtype=torch.long), "lengths": torch.tensor([7, 5, 6]),
             "prompt_lengths": torch.tensor([2, 1, 3]), "logprobs": behaviour,
             "advantages": adv}
    mask = response_mask(batch["lengths"], batch["prompt_lengths"], 7)
    for agg in AGGS:
        loss, m = policy_surrogate(new, batch, 0.2, agg, 5.0)
        loss_c, m_c = clipped_surrogate(new, behaviour, adv, mask, 0.2, agg)
        assert torch.equal(loss, loss_c) and m.keys() == m_c.keys()
        loss_d, m_d = policy_surrogate(new, {**batch, "prox_logprobs": prox}, 0.2, agg, 5.0)
        assert torch.equal(loss_d, decoupled_surrogate(new, prox, behaviour, adv, mask, 0.2,
                                                       5.0, agg)[0])
        assert "behave_weight" in m_d and not torch.equal(loss_d, loss_c)


# ---- (b) by hand --------------------------------------------------------------------

def test_decoupled_surrogate_by_hand():
    # four response tokens and one padding position (huge weight, must not count);
    # behaviour weights pi_prox/pi_behave 1.5, 4 (capped at 2), 0.5, 1;
    # ratios pi_new/pi_prox 1.5, 0.5, 1, 1.1; advantages 1, -1, 2, -2; eps 0.2
    behaviour = t([[-1, -1, -2, -1, -9]])
    prox = behaviour + t([[math.log(1.5), math.log(4), math.log(0.5), 0, 9]])
    new = prox + t([[math.log(1.5), math.log(0.5), 0, math.log(1.1), 7]])
    adv = t([[1, -1, 2, -2, 100]])
    mask = t([[1, 1, 1, 1, 0]])
    loss, m = decoupled_surrogate(new, prox, behaviour, adv, mask, clip_ratio=0.2,
                                  weight_cap=2.0)
    # per token w * max(-r A, -clip(r) A):
    # 1.5 * max(-1.5, -1.2) = -1.8 (clipped); 2 * max(0.5, 0.8) = 1.6 (clipped);
    # 0.5 * max(-2, -2) = -1; 1 * max(2.2, 2.2) = 2.2
    assert loss.item() == pytest.approx((-1.8 + 1.6 - 1 + 2.2) / 4)
    loss_s, _ = decoupled_surrogate(new, prox, behaviour, adv, mask, 0.2, 2.0,
                                    "seq_mean_token_mean")
    assert loss_s.item() == pytest.approx(0.25)       # one sequence: the same mean
    assert m["clip_frac"].item() == pytest.approx(0.5)
    assert m["ratio"].item() == pytest.approx((1.5 + 0.5 + 1 + 1.1) / 4)
    assert m["approx_kl"].item() == pytest.approx(
        -(math.log(1.5) + math.log(0.5) + math.log(1.1)) / 4)
    assert m["behave_weight"].item() == pytest.approx((1.5 + 2 + 0.5 + 1) / 4)
    assert m["behave_weight_capped_frac"].item() == pytest.approx(0.25)
    assert all(v.dim() == 0 and not v.requires_grad for v in m.values())


# ---- (c) gradient: the importance-weighted policy gradient ------------------------

@pytest.mark.parametrize("agg", AGGS)
def test_gradient_at_the_proximal_policy_is_the_weighted_policy_gradient(agg):
    behaviour, prox, _, adv, mask = _random(seed=1)
    cap = 2.0
    w = torch.clamp(torch.exp(prox - behaviour), max=cap)
    assert ((torch.exp(prox - behaviour) > cap) & (mask > 0)).any()   # the cap bites
    # a small policy: logp_new = prox + x @ theta, at theta = 0 (so pi_new == pi_prox)
    x = torch.randn(*prox.shape, 4, generator=torch.Generator().manual_seed(2))
    theta = torch.zeros(4, requires_grad=True)
    loss, _ = decoupled_surrogate(prox + x @ theta, prox, behaviour, adv, mask, 0.2, cap, agg)
    (grad,) = torch.autograd.grad(loss, theta)
    # -w A grad log pi, aggregated like the loss
    theta_pg = torch.zeros(4, requires_grad=True)
    per_token = -w * adv * (prox + x @ theta_pg)
    if agg == "token_mean":
        pg = (per_token * mask).sum() / mask.sum()
    else:
        pg = ((per_token * mask).sum(1) / mask.sum(1)).mean()
    (expected,) = torch.autograd.grad(pg, theta_pg)
    torch.testing.assert_close(grad, expected)
    # and per token: d loss / d logp_t = -w_t A_t / (tokens) for the token mean
    if agg == "token_mean":
        lp = prox.clone().requires_grad_()
        decoupled_surrogate(lp, prox, behaviour, adv, mask, 0.2, cap, agg)[0].backward()
        torch.testing.assert_close(lp.grad, -w * adv * mask / mask.sum())


# ---- (d) every actor loss reads prox_logprobs --------------------------------------

def _rollout(**extra):
    g = torch.Generator().manual_seed(3)
    return {"tokens": torch.zeros(4, 5, dtype=torch.long), "lengths": torch.tensor([5, 4, 5, 3]),
            "prompt_lengths": torch.tensor([2, 2, 3, 1]), "rewards": t([1, 0, 0, 2]),
            "logprobs": -torch.rand(4, 4, generator=g),
            "ref_logprobs": -torch.rand(4, 4, generator=g),
            "values": torch.randn(4, 5, generator=g), **extra}


CASES = [
    (grpo, grpo.GRPOConfig(samples_per_prompt=2), {}),
    (grpo, grpo.GRPOConfig(samples_per_prompt=2, loss_agg="token_mean"), {}),
    (ppo, ppo.PPOConfig(), {}),
    (ppo, ppo.PPOConfig(kl_in_reward=False, kl_estimator="k3"), {}),
    (rloo, rloo.RLOOConfig(samples_per_prompt=2), {}),
    (remax, remax.ReMaxConfig(samples_per_prompt=2), {"greedy_rewards": t([0.5, 1.0])}),
    (reinforce_pp, reinforce_pp.ReinforcePPConfig(), {}),
]


@pytest.mark.parametrize("mod,cfg,extra", CASES)
def test_actor_loss_uses_prox_logprobs_when_present(mod, cfg, extra):
    rollout = _rollout(**extra)
    shift = 0.5 * torch.randn(4, 4, generator=torch.Generator().manual_seed(4))
    plain = mod.prepare(rollout, cfg)
    stale = mod.prepare({**rollout, "prox_logprobs": rollout["logprobs"] + shift}, cfg)
    same = mod.prepare({**rollout, "prox_logprobs": rollout["logprobs"].clone()}, cfg)
    # the advantages (and the KL in the reward) stay on the behaviour log-probs
    torch.testing.assert_close(stale["advantages"], plain["advantages"], rtol=0, atol=0)
    new = rollout["logprobs"] + shift + 0.1
    loss, m = mod.actor_loss_fn(cfg)(new, plain)
    loss_same, m_same = mod.actor_loss_fn(cfg)(new, same)
    loss_stale, m_stale = mod.actor_loss_fn(cfg)(new, stale)
    assert torch.equal(loss_same, loss)
    assert not torch.isclose(loss_stale, loss)
    assert "behave_weight" not in m
    assert {"behave_weight", "behave_weight_capped_frac"} <= m_stale.keys() <= (
        m.keys() | {"behave_weight", "behave_weight_capped_frac"})
    assert m_same["behave_weight"].item() == 1.0
    # ratio and approx_kl are taken against the proximal policy
    mask = response_mask(rollout["lengths"], rollout["prompt_lengths"], 5)
    assert m_stale["approx_kl"].item() == pytest.approx(
        ((stale["prox_logprobs"] - new) * mask).sum().item() / mask.sum().item())


@pytest.mark.parametrize("mod,cfg,extra", CASES)
def test_actor_loss_with_prox_descends(mod, cfg, extra):
    batch = mod.prepare(_rollout(**extra), cfg)
    batch["prox_logprobs"] = batch["logprobs"] + 0.3
    theta = torch.zeros(4, 4, requires_grad=True)
    loss_fn = mod.actor_loss_fn(cfg)
    loss, _ = loss_fn(batch["prox_logprobs"] + theta, batch)
    loss.backward()
    with torch.no_grad():
        after, _ = loss_fn(batch["prox_logprobs"] + theta - 0.01 * theta.grad, batch)
    assert after < loss
    mask = response_mask(batch["lengths"], batch["prompt_lengths"], 5)
    assert (theta.grad[mask == 0] == 0).all()


# ---- (e) the config field ----------------------------------------------------------

@pytest.mark.parametrize("config", [grpo.GRPOConfig, ppo.PPOConfig, rloo.RLOOConfig,
                                    remax.ReMaxConfig, reinforce_pp.ReinforcePPConfig])
def test_behave_weight_cap_defaults_to_5_and_must_be_positive(config):
    if "samples_per_prompt" in config.model_fields:      # the batch shape's, no default
        config = partial(config, samples_per_prompt=2)
    assert config().behave_weight_cap == 5.0
    assert config(behave_weight_cap=1.5).behave_weight_cap == 1.5
    for bad in (0, -1.0):
        with pytest.raises(ValidationError, match="behave_weight_cap"):
            config(behave_weight_cap=bad)
