"""The loss mask of a multi-turn rollout is exact: no algorithm's loss has a gradient
through the logits (or values) at the positions that score observation tokens, and
GRPO's loss on a two-turn example equals the hand computation over model tokens only."""
from __future__ import annotations

import math

import pytest
import torch

from realign.agents.rollout import _State, episode_records
from realign.algorithms import dapo, dr_grpo, grpo, gspo, ppo, reinforce_pp, rloo
from realign.algorithms.common import batch_mask, minibatch, pop_stats
from realign.algorithms.params import (
    DAPOConfig,
    DrGRPOConfig,
    GRPOConfig,
    GSPOConfig,
    PPOConfig,
    ReinforcePPConfig,
    RLOOConfig,
)

pytestmark = pytest.mark.torch

V = 7


def two_turn_batch() -> dict:
    """Row 0: prompt [1, 2], turn 1 [3, 4, 5], observation [6, 6], turn 2 [3, 2];
    row 1: the same prompt, one turn [4, 5]. Log-prob positions scoring model tokens:
    row 0 -> 1, 2, 3 and 6, 7 (4, 5 score the observation); row 1 -> 1, 2."""
    a = _State(None, [1, 2], 100)
    a.add([3, 4, 5], [-1.0, -1.1, -1.2])
    a.add([6, 6], None)
    a.answer_start = len(a.response)
    a.add([3, 2], [-0.9, -0.8])
    b = _State(None, [1, 2], 100)
    b.add([4, 5], [-0.7, -0.6])
    seqs, lp = episode_records([a, b], pad_id=0)
    return {**seqs, **lp, "rewards": torch.tensor([1.0, 0.0])}


MODEL = {0: [1, 2, 3, 6, 7], 1: [1, 2]}
OBS = {0: [4, 5], 1: []}


def test_the_record_marks_model_tokens_only():
    batch = two_turn_batch()
    mask = batch_mask(batch)
    assert mask[0].nonzero().flatten().tolist() == MODEL[0]
    assert mask[1].nonzero().flatten().tolist() == MODEL[1]
    assert batch["tokens"][0].tolist() == [1, 2, 3, 4, 5, 6, 6, 3, 2]
    assert int(batch["answer_start"][0]) == 7


def new_logprobs(batch, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(*batch["tokens"].shape, V, generator=g).requires_grad_()
    lp = logits[:, :-1].log_softmax(-1).gather(2, batch["tokens"][:, 1:].unsqueeze(2))
    return logits, lp.squeeze(2)


def assert_zero_grad_at_observations(grad: torch.Tensor, clipped=()) -> None:
    """Zero at every observation position, non-zero at every model position (but
    those ``clipped``, where the clipped objective has no gradient)."""
    for row, positions in OBS.items():
        for t in positions:
            assert torch.count_nonzero(grad[row, t]) == 0, (row, t)
    for row, positions in MODEL.items():
        for t in positions:
            if (row, t) not in clipped:
                assert torch.count_nonzero(grad[row, t]) > 0, (row, t)


def test_grpo_loss_equals_the_hand_computation_over_model_tokens():
    batch = two_turn_batch()
    cfg = GRPOConfig(samples_per_prompt=2, kl_coef=0.0, clip_ratio=0.2)
    prepared = grpo.prepare(batch, cfg)
    logits, lp = new_logprobs(batch)
    # the rollout's log-probs differ from the new ones so that some ratios clip
    old = lp.detach() + torch.tensor([[0, .3, -.3, .05, 9, 9, .25, -.1],
                                      [0, -.4, .1, 0, 0, 0, 0, 0]])
    prepared["logprobs"] = old
    loss, _ = grpo.actor_loss(lp, prepared, cfg)
    loss.backward()
    std = math.sqrt(0.5)                             # unbiased std of rewards (1, 0)
    adv = {0: 0.5 / (std + cfg.eps), 1: -0.5 / (std + cfg.eps)}
    per_row = []
    for row, positions in MODEL.items():
        terms = []
        for t in positions:
            r = math.exp(float(lp[row, t].detach() - old[row, t]))
            a = adv[row]
            terms.append(max(-r * a, -min(max(r, 0.8), 1.2) * a))
        per_row.append(sum(terms) / len(terms))
    assert loss.detach().item() == pytest.approx(sum(per_row) / 2, rel=1e-6)
    # ratios e^0.3 (A > 0) and e^-0.25 ... : (0, 2) clips above, (0, 1) below
    assert_zero_grad_at_observations(logits.grad, clipped={(0, 2)})


@pytest.mark.parametrize("name", ["rloo", "reinforce_pp", "ppo"])
def test_rloo_reinforce_pp_and_ppo_train_on_model_tokens_only(name):
    batch = two_turn_batch()
    batch["ref_logprobs"] = batch["logprobs"] - 0.05 * batch["action_mask"]
    if name == "rloo":
        cfg, mod = RLOOConfig(samples_per_prompt=2, kl_coef=0.1), rloo
    elif name == "reinforce_pp":
        cfg, mod = ReinforcePPConfig(kl_coef=0.1, gamma=0.9), reinforce_pp
    else:
        cfg, mod = PPOConfig(kl_coef=0.1, gamma=0.9, lam=0.9), ppo
        batch["values"] = torch.linspace(-1, 1, 18).reshape(2, 9)
    logits, lp = new_logprobs(batch, seed=1)
    batch["logprobs"] = lp.detach() * batch["action_mask"]       # ratio 1: no clipping
    prepared = mod.prepare(batch, cfg)
    obs = torch.zeros_like(prepared["advantages"], dtype=torch.bool)
    obs[0, OBS[0]] = True
    assert torch.count_nonzero(prepared["advantages"][obs]) == 0
    assert torch.count_nonzero(prepared["advantages"][batch_mask(batch) > 0]) > 0
    loss, _ = mod.actor_loss_fn(cfg)(lp, prepared) if name != "ppo" else \
        ppo.actor_loss(lp, prepared, cfg)
    loss.backward()
    assert_zero_grad_at_observations(logits.grad)
    if name == "ppo":
        assert torch.count_nonzero(prepared["returns"][obs]) == 0
        noise = torch.randn(2, 9, generator=torch.Generator().manual_seed(2))
        values = (batch["values"] + 0.05 * noise).requires_grad_()   # within value_clip
        vloss, _ = ppo.critic_loss(values, prepared, cfg)
        vloss.backward()
        assert_zero_grad_at_observations(values.grad.unsqueeze(2))


@pytest.mark.parametrize("name", ["dapo", "gspo", "dr_grpo"])
def test_dapo_gspo_and_dr_grpo_train_on_model_tokens_only(name):
    """Each with a KL term, so its masking is covered too; DAPO through the mini-batch
    its token-level mean divides by (the model tokens of both rows: 5 + 2)."""
    batch = two_turn_batch()
    batch["ref_logprobs"] = batch["logprobs"] - 0.05 * batch["action_mask"]
    logits, lp = new_logprobs(batch, seed=1)
    batch["logprobs"] = lp.detach() * batch["action_mask"]       # ratio 1: no clipping
    if name == "dapo":
        cfg = DAPOConfig(samples_per_prompt=2, prompts_per_step=1, gen_len=100, kl_coef=0.1)
        prepared, _ = pop_stats(dapo.prepare(batch, cfg))
        prepared = minibatch(prepared, 0, 1)
        assert torch.equal(prepared["loss_mask"], batch_mask(batch))
        assert prepared["minibatch_tokens"].tolist() == [7.0, 7.0]
        loss_fn = dapo.actor_loss_fn(cfg)
    elif name == "gspo":
        cfg = GSPOConfig(samples_per_prompt=2, kl_coef=0.1)
        prepared, loss_fn = grpo.prepare(batch, cfg), gspo.actor_loss_fn(cfg)
    else:
        cfg = DrGRPOConfig(samples_per_prompt=2, gen_len=100, kl_coef=0.1)
        prepared, loss_fn = dr_grpo.prepare(batch, cfg), dr_grpo.actor_loss_fn(cfg)
    obs = torch.zeros_like(prepared["advantages"], dtype=torch.bool)
    obs[0, OBS[0]] = True
    assert torch.count_nonzero(prepared["advantages"][obs]) == 0
    model = batch_mask(batch) > 0
    assert torch.count_nonzero(prepared["advantages"][model]) == int(model.sum())
    loss, metrics = loss_fn(lp, prepared)
    loss.backward()
    assert_zero_grad_at_observations(logits.grad)
    assert metrics["kl"].item() > 0
    # what the observation's log-probs are does not move the loss
    moved = lp.detach().clone()
    moved[0, OBS[0]] += 3.0
    assert loss_fn(moved, prepared)[0].item() == pytest.approx(loss.item(), rel=1e-6)


def test_gae_bootstraps_across_an_observation():
    """mask [1, 0, 1], gamma = lam = 1, rewards [0, 0, 1], values [v0, -, v2]:
    A2 = 1 - v2, A0 = (v2 - v0) + A2 = 1 - v0; the observation's value is not read."""
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    adv, ret = ppo.gae(torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.25, 7.0, 0.5]]),
                       mask, gamma=1.0, lam=1.0)
    assert adv.tolist() == [[0.75, 0.0, 0.5]]
    assert ret.tolist() == [[1.0, 0.0, 1.0]]
    # with gamma 0.5 the observation is not a time step: A0 = 0.5 * v2 - v0 + 0.5 * A2
    adv, _ = ppo.gae(torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.25, 7.0, 0.5]]),
                     mask, gamma=0.5, lam=1.0)
    assert adv[0, 0].item() == pytest.approx(0.5 * 0.5 - 0.25 + 0.5 * 0.5)
