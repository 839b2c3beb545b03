"""DPO (sigmoid, label smoothing, IPO), SFT and the Bradley-Terry reward-model loss
against hand-computed values."""
from __future__ import annotations

import math

import pytest
import torch

from realign.algorithms import dpo, rm, sft
from realign.algorithms.common import response_mask
from realign.errors import UserError

pytestmark = pytest.mark.torch


def t(x):
    return torch.tensor(x, dtype=torch.float32)


def softplus(x):
    return math.log1p(math.exp(x))          # -log sigma(-x)


def _pairs():
    """Two pairs, s = 5 (4 log-prob positions). Pair 0: chosen has two response tokens
    (prompt 2, length 4 -> positions 1, 2), rejected one (prompt 3, length 4 ->
    position 2). Prompt/padding positions hold garbage (-9) that must not count.
    Pair 1 is pair 0 with the roles swapped."""
    ref = t([[-9, -2, -2, -9], [-9, -9, -1, -9], [-9, -9, -1, -9], [-9, -2, -2, -9]])
    new = t([[-9, -1, -1, -9], [-9, -9, -3, -9], [-9, -9, -3, -9], [-9, -1, -1, -9]])
    batch = {"tokens": torch.zeros(4, 5, dtype=torch.long),
             "lengths": torch.tensor([4, 4, 4, 4]),
             "prompt_lengths": torch.tensor([2, 3, 3, 2]), "ref_logprobs": ref}
    return new, batch


def test_dpo_sigmoid_by_hand():
    new, batch = _pairs()
    # pair 0: chosen log-ratio (-2) - (-4) = 2, rejected (-3) - (-1) = -2 -> h = 4;
    # beta 0.25 -> beta*h = 1 -> loss log(1 + e^-1). Pair 1: h = -4 -> log(1 + e).
    loss, m = dpo.actor_loss(new, batch, dpo.DPOConfig(beta=0.25))
    assert loss.item() == pytest.approx((softplus(-1) + softplus(1)) / 2)
    assert m["reward_accuracy"].item() == 0.5
    assert m["reward_chosen"].item() == pytest.approx(0.0)      # (0.5 + -0.5) / 2
    assert m["reward_margin"].item() == pytest.approx(0.0)      # (1 + -1) / 2
    loss0, m0 = dpo.actor_loss(new[:2], {k: v[:2] for k, v in batch.items()},
                               dpo.DPOConfig(beta=0.25))
    assert loss0.item() == pytest.approx(softplus(-1))
    assert (m0["reward_chosen"].item(), m0["reward_rejected"].item()) == (0.5, -0.5)
    assert (m0["reward_margin"].item(), m0["reward_accuracy"].item()) == (1.0, 1.0)


def test_dpo_label_smoothing_and_ipo_by_hand():
    new, batch = _pairs()
    b0 = {k: v[:2] for k, v in batch.items()}
    ls, _ = dpo.actor_loss(new[:2], b0, dpo.DPOConfig(beta=0.25, label_smoothing=0.1))
    assert ls.item() == pytest.approx(0.9 * softplus(-1) + 0.1 * softplus(1))
    # IPO: (h - 1/(2 beta))^2 with h = 4, 1/(2*0.25) = 2 -> 4; pair 1: (-4 - 2)^2 = 36
    ipo, _ = dpo.actor_loss(new, batch, dpo.DPOConfig(beta=0.25, loss="ipo"))
    assert ipo.item() == pytest.approx((4 + 36) / 2)


def test_dpo_at_the_reference_is_log2_and_gradient_prefers_chosen():
    _, batch = _pairs()
    theta = torch.zeros(4, 4, requires_grad=True)
    loss, _ = dpo.actor_loss(batch["ref_logprobs"] + theta, batch, dpo.DPOConfig())
    assert loss.item() == pytest.approx(math.log(2))
    loss.backward()
    mask = response_mask(batch["lengths"], batch["prompt_lengths"], 5)
    assert (theta.grad[0::2][mask[0::2] > 0] < 0).all()      # chosen pushed up
    assert (theta.grad[1::2][mask[1::2] > 0] > 0).all()      # rejected pushed down
    assert (theta.grad[mask == 0] == 0).all()
    with torch.no_grad():
        after, _ = dpo.actor_loss(batch["ref_logprobs"] + theta - 0.1 * theta.grad, batch,
                                  dpo.DPOConfig())
    assert after < loss


def test_pairs_need_an_even_row_count():
    new, batch = _pairs()
    odd = {k: v[:3] for k, v in batch.items()}
    with pytest.raises(UserError, match="even number of rows"):
        dpo.actor_loss(new[:3], odd, dpo.DPOConfig())
    with pytest.raises(UserError, match="even number of rows"):
        dpo.prepare(odd, dpo.DPOConfig())
    with pytest.raises(UserError, match="even number of rows"):
        rm.reward_loss(torch.zeros(3, 5), odd, rm.RMConfig())


def test_sft_masked_nll_by_hand():
    batch = {"tokens": torch.zeros(2, 5, dtype=torch.long), "lengths": torch.tensor([5, 3]),
             "prompt_lengths": torch.tensor([2, 2])}
    batch = sft.prepare(batch, sft.SFTConfig())
    assert batch["loss_mask"].tolist() == [[0, 1, 1, 1], [0, 1, 0, 0]]
    lp = t([[-9, -1, -2, -3], [-9, -6, -9, -9]])
    loss, m = sft.actor_loss(lp, batch, sft.SFTConfig())
    assert loss.item() == pytest.approx((1 + 2 + 3 + 6) / 4)
    assert m["tokens"].item() == 4
    seq, _ = sft.actor_loss(lp, batch, sft.SFTConfig(loss_agg="seq_mean_token_mean"))
    assert seq.item() == pytest.approx((2 + 6) / 2)


def test_rm_bradley_terry_by_hand():
    # scores are the values at each sequence's last token (length - 1)
    lengths = torch.tensor([3, 2, 4, 4])
    values = t([[9, 9, 1 + math.log(3), 9], [9, 1, 9, 9],      # margin ln 3
                [9, 9, 9, 0.0], [9, 9, 9, 0.0]])              # margin 0
    batch = {"tokens": torch.zeros(4, 4, dtype=torch.long), "lengths": lengths}
    loss, m = rm.reward_loss(values, batch, rm.RMConfig())
    # -log sigma(ln 3) = -log(3/4); -log sigma(0) = log 2
    assert loss.item() == pytest.approx((math.log(4 / 3) + math.log(2)) / 2)
    assert m["accuracy"].item() == 0.5
    assert m["margin"].item() == pytest.approx(math.log(3) / 2)
    assert rm.sequence_scores(values, lengths).tolist() == pytest.approx(
        [1 + math.log(3), 1, 0, 0])


def test_rm_gradient_raises_chosen_and_lowers_rejected_last_token_only():
    batch = {"tokens": torch.zeros(2, 4, dtype=torch.long), "lengths": torch.tensor([3, 4])}
    v = torch.zeros(2, 4, requires_grad=True)
    loss, _ = rm.reward_loss(v, batch, rm.RMConfig())
    loss.backward()
    assert v.grad.tolist() == [[0, 0, -0.5, 0], [0, 0, 0, 0.5]]
