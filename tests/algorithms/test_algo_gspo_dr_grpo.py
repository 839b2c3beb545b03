"""GSPO (the sequence ratio and each side of its clip) and Dr. GRPO (no std, no length
normalisation) against hand-computed values, and against GRPO where they must agree."""
from __future__ import annotations

import math

import pytest
import torch

from realign.algorithms import dr_grpo, grpo, gspo, registry
from realign.algorithms.params import DrGRPOConfig, GRPOConfig, GSPOConfig

pytestmark = pytest.mark.torch


def t(x):
    return torch.tensor(x, dtype=torch.float32)


def rows(log_ratios, advantages):
    """One row per entry: two response tokens (positions 1, 2 of 3) with these log
    ratios log pi - log pi_old, the row's advantage on both."""
    b = len(log_ratios)
    batch = {"tokens": torch.zeros(b, 4, dtype=torch.long), "lengths": torch.full((b,), 4),
             "prompt_lengths": torch.full((b,), 2), "logprobs": torch.full((b, 3), -1.0),
             "advantages": t([[0, a, a] for a in advantages])}
    new = (t([[9.0, x, y] for x, y in log_ratios]) - 1.0).requires_grad_()
    return new, batch


# ---- GSPO ----------------------------------------------------------------------------

def test_gspo_sequence_ratio_and_each_clip_side_by_hand():
    # clips 3e-4 (low) / 4e-4 (high); s = exp(mean of the row's token log ratios)
    # row 0: +0.001, +0.003 -> s = e^0.002 > 1.0004, A = +1: high side, -1.0004
    # row 1: -0.0001 twice  -> s = e^-0.0001, A = -1: inside, s
    # row 2: -0.001 twice   -> s = e^-0.001 < 0.9997, A = -1: low side, 0.9997
    # row 3: -0.001 twice   -> s = e^-0.001, A = +1: a shrunk ratio with A > 0 is not
    #                          clipped, -s
    new, batch = rows([(0.001, 0.003), (-1e-4, -1e-4), (-1e-3, -1e-3), (-1e-3, -1e-3)],
                      [1, -1, -1, 1])
    loss, m = gspo.actor_loss(new, batch, GSPOConfig(samples_per_prompt=2))
    s1, s3 = math.exp(-1e-4), math.exp(-1e-3)
    assert loss.item() == pytest.approx((-1.0004 + s1 + 0.9997 - s3) / 4, abs=1e-7)
    assert m["clip_frac_high"].item() == 0.25 and m["clip_frac_low"].item() == 0.25
    assert m["clip_frac"].item() == 0.5
    loss.backward()
    # d s / d log pi_t = s / |y| (2 tokens), over 4 rows; clipped rows give nothing
    g = new.grad[:, 1:]
    assert g[0].tolist() == [0, 0] and g[2].tolist() == [0, 0]
    assert g[1].tolist() == pytest.approx([s1 / 2 / 4] * 2)
    assert g[3].tolist() == pytest.approx([-s3 / 2 / 4] * 2)


def test_gspo_clips_a_sequence_that_token_clipping_would_keep():
    # every token's ratio is e^0.002 = 1.002: far inside PPO's 0.2, outside GSPO's 4e-4
    new, batch = rows([(0.002, 0.002)], [1.0])
    loss, m = gspo.actor_loss(new, batch, GSPOConfig(samples_per_prompt=2))
    assert m["clip_frac"].item() == 1.0
    assert loss.item() == pytest.approx(-1.0004, abs=1e-7)


def test_gspo_on_policy_gradient_is_grpos():
    """At ratio 1 (the first update on a fresh rollout) the sequence ratio's gradient
    is the mean of its tokens', which is GRPO's with per-sequence token means: the two
    differ only off-policy, where GSPO clips whole sequences."""
    g = torch.Generator().manual_seed(0)
    b, s = 4, 7
    logprobs = -torch.rand(b, s - 1, generator=g)
    batch = {"tokens": torch.zeros(b, s, dtype=torch.long),
             "lengths": torch.tensor([7, 5, 6, 4]), "prompt_lengths": torch.tensor([2, 2, 3, 1]),
             "logprobs": logprobs, "rewards": t([1, 0, 0.5, 2])}
    grads = []
    for name, mod, c in (("gspo", gspo, GSPOConfig(samples_per_prompt=2)),
                         ("grpo", grpo, GRPOConfig(samples_per_prompt=2, kl_coef=0.0))):
        new = logprobs.clone().requires_grad_()
        loss, _ = mod.actor_loss(new, registry.get(name).prepare(batch, c), c)
        grads.append(torch.autograd.grad(loss, new)[0])
    torch.testing.assert_close(grads[0], grads[1])


def test_gspo_asynchronous_weights_each_sequence_by_its_behaviour_ratio():
    # prox - behaviour = ln 2 on both tokens of row 0 -> w = 2; ln 8 on row 1 -> 8,
    # capped at 5; the ratio is taken against prox (here equal to the new policy)
    new, batch = rows([(0.0, 0.0), (0.0, 0.0)], [1, -1])
    batch["prox_logprobs"] = new.detach().clone()
    ln2, ln8 = math.log(2), math.log(8)
    batch["logprobs"] = batch["prox_logprobs"] - t([[0, ln2, ln2], [0, ln8, ln8]])
    loss, m = gspo.actor_loss(new, batch, GSPOConfig(samples_per_prompt=2))
    assert loss.item() == pytest.approx((2 * -1 + 5 * 1) / 2)
    assert m["behave_weight"].item() == pytest.approx(3.5)
    assert m["behave_weight_capped_frac"].item() == 0.5


# ---- Dr. GRPO ------------------------------------------------------------------------

def test_dr_grpo_centres_without_the_std():
    adv = dr_grpo.centred_advantages(t([1, 0, 0, 0, 3, 5, 5, 3]), 4)
    assert adv.tolist() == [0.75, -0.25, -0.25, -0.25, -1, 1, 1, -1]
    # GRPO divides by the group's std (0.5 and 1.1547)
    assert grpo.group_advantages(t([1, 0, 0, 0]), 4, eps=1e-12).tolist() == pytest.approx(
        [1.5, -0.5, -0.5, -0.5])


def _short_and_long():
    # row 0: one response token with A = 2; row 1: three with A = -1; ratio 1
    batch = {"tokens": torch.zeros(2, 5, dtype=torch.long), "lengths": torch.tensor([3, 5]),
             "prompt_lengths": torch.tensor([2, 2]), "logprobs": torch.zeros(2, 4),
             "advantages": t([[0, 2, 0, 0], [0, -1, -1, -1]])}
    return torch.zeros(2, 4, requires_grad=True), batch


def test_dr_grpo_divides_token_sums_by_a_constant():
    new, batch = _short_and_long()
    loss, _ = dr_grpo.actor_loss(new, batch, DrGRPOConfig(samples_per_prompt=2, gen_len=4))
    # (-2 + 3) / (2 rows * 4): GRPO's per-sequence means give (-2 + 1) / 2 = -0.5
    assert loss.item() == pytest.approx(1 / 8)
    loss.backward()
    # every token's gradient is -A / 8, whatever its response's length (GRPO: -A / (2|o|))
    assert new.grad[0, 1].item() == pytest.approx(-2 / 8)
    assert new.grad[1, 1:].tolist() == pytest.approx([1 / 8] * 3)


def test_dr_grpo_is_exact_over_micro_batches():
    new, batch = _short_and_long()
    c = DrGRPOConfig(samples_per_prompt=2, gen_len=4)
    whole, _ = dr_grpo.actor_loss(new, batch, c)
    parts = [dr_grpo.actor_loss(new[i:i + 1], {k: v[i:i + 1] for k, v in batch.items()}, c)[0]
             for i in range(2)]
    assert (sum(parts) / 2).item() == pytest.approx(whole.item())
