"""Shared algorithm pieces against hand-computed values: the response mask, masked
statistics, KL estimators, discounted returns and the clipped surrogate."""
from __future__ import annotations

import math

import pytest
import torch

from realign.algorithms.common import (
    aggregate,
    broadcast_to_tokens,
    clipped_surrogate,
    discounted_returns,
    kl_penalty,
    last_token_scores,
    masked_mean,
    masked_whiten,
    response_mask,
    sequence_logprob,
)

pytestmark = pytest.mark.torch

LN2 = math.log(2)


def t(x):
    return torch.tensor(x, dtype=torch.float32)


def test_response_mask_marks_positions_predicting_response_tokens():
    # s=6: prompt 2, length 5 -> tokens 2,3,4 are predicted at positions 1,2,3.
    # prompt 3, length 6 -> tokens 3,4,5 at positions 2,3,4. prompt 1, length 2 -> 0.
    m = response_mask(torch.tensor([5, 6, 2]), torch.tensor([2, 3, 1]), 6)
    assert m.tolist() == [[0, 1, 1, 1, 0], [0, 0, 1, 1, 1], [1, 0, 0, 0, 0]]
    assert m.dtype == torch.float32


def test_masked_mean_ignores_masked_entries_and_empty_mask_is_zero():
    x = t([[1, 2, 100], [3, 100, 100]])
    mask = t([[1, 1, 0], [1, 0, 0]])
    assert masked_mean(x, mask).item() == pytest.approx(2.0)
    assert masked_mean(x, mask, dim=1).tolist() == pytest.approx([1.5, 3.0])
    assert masked_mean(x, torch.zeros_like(mask)).item() == 0.0


def test_masked_whiten_uses_masked_statistics_and_zeroes_the_rest():
    x = t([[1, 3, 99], [-50, 2, 2]])
    mask = t([[1, 1, 0], [0, 1, 1]])
    # masked values 1, 3, 2, 2: mean 2, population variance (1+1+0+0)/4 = 0.5
    s = math.sqrt(0.5)
    assert masked_whiten(x, mask).tolist() == [pytest.approx([-1 / s, 1 / s, 0], abs=1e-6),
                                               pytest.approx([0, 0, 0], abs=1e-6)]


def test_kl_estimators_by_hand():
    lp, ref = t([math.log(0.5)]), t([math.log(0.25)])   # log r = log(ref/pi) = -ln 2
    assert kl_penalty(lp, ref, "k1").item() == pytest.approx(LN2)
    assert kl_penalty(lp, ref, "k2").item() == pytest.approx(LN2 ** 2 / 2)
    assert kl_penalty(lp, ref, "k3").item() == pytest.approx(0.5 - 1 + LN2)
    assert kl_penalty(lp, ref, "low_var_kl").item() == pytest.approx(0.5 - 1 + LN2)
    # ref more likely than pi: r = 2 -> k1 = -ln2 (negative), k3 = 1 - ln2 (>= 0)
    assert kl_penalty(ref, lp, "k1").item() == pytest.approx(-LN2)
    assert kl_penalty(ref, lp, "k3").item() == pytest.approx(1 - LN2)
    assert kl_penalty(lp, lp, "k3").item() == 0.0
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_penalty(lp, ref, "k4")


def test_last_token_scores_and_broadcast():
    mask = t([[0, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    assert last_token_scores(t([5, 7, 9]), mask).tolist() == [[0, 0, 5, 0], [0, 0, 0, 7],
                                                              [0, 0, 0, 0]]
    assert broadcast_to_tokens(t([2, -1, 3]), mask).tolist() == [[0, 2, 2, 0],
                                                                [-1, -1, -1, -1], [0] * 4]


def test_discounted_returns_by_hand():
    # response at positions 1..3 with rewards 1, 2, 4; gamma 0.5; the prompt position
    # and the padding position carry rewards that must not leak in.
    r = t([[100, 1, 2, 4, 100]])
    mask = t([[0, 1, 1, 1, 0]])
    # G3 = 4, G2 = 2 + 0.5*4 = 4, G1 = 1 + 0.5*4 = 3
    assert discounted_returns(r, mask, 0.5).tolist() == [[0, 3, 4, 4, 0]]
    assert discounted_returns(r, mask, 1.0).tolist() == [[0, 7, 6, 4, 0]]


def test_aggregate_token_mean_vs_sequence_mean():
    x = t([[1, 3, 50], [6, 50, 50]])
    mask = t([[1, 1, 0], [1, 0, 0]])
    assert aggregate(x, mask, "token_mean").item() == pytest.approx(10 / 3)
    assert aggregate(x, mask, "seq_mean_token_mean").item() == pytest.approx(4.0)
    # a row without response tokens does not count as a sequence
    x3, m3 = torch.cat([x, t([[9, 9, 9]])]), torch.cat([mask, t([[0, 0, 0]])])
    assert aggregate(x3, m3, "seq_mean_token_mean").item() == pytest.approx(4.0)


def test_clipped_surrogate_by_hand():
    old = torch.zeros(1, 5)
    # ratios 1.5, 1.5, 0.5, 0.5 on response tokens; last position is padding
    new = t([[math.log(1.5), math.log(1.5), math.log(0.5), math.log(0.5), 7.0]])
    adv = t([[1, -1, 1, -1, 100]])
    mask = t([[1, 1, 1, 1, 0]])
    loss, m = clipped_surrogate(new, old, adv, mask, clip_ratio=0.2)
    # per token: max(-1.5, -1.2) = -1.2; max(1.5, 1.2) = 1.5; max(-0.5, -0.8) = -0.5;
    # max(0.5, 0.8) = 0.8 (clipped)
    assert loss.item() == pytest.approx((-1.2 + 1.5 - 0.5 + 0.8) / 4)
    assert m["clip_frac"].item() == pytest.approx(0.5)
    assert m["ratio"].item() == pytest.approx(1.0)
    assert m["approx_kl"].item() == pytest.approx(-(2 * math.log(1.5) + 2 * math.log(0.5)) / 4)


def test_clipped_surrogate_gradient_is_zero_where_clipped():
    new = torch.tensor([[math.log(1.5), math.log(1.5)]], requires_grad=True)
    loss, _ = clipped_surrogate(new, torch.zeros(1, 2), t([[1, -1]]), t([[1, 1]]), 0.2)
    loss.backward()
    # token 0: clipped (ratio above 1+eps with A > 0) -> no gradient;
    # token 1: unclipped -> d/dx (1.5 e^(x - ln1.5)) / 2 = 0.75
    assert new.grad.tolist() == [[0.0, pytest.approx(0.75)]]


def test_sequence_logprob_sums_response_tokens():
    lp = t([[-9, -1, -2, -9], [-9, -9, -3, -9]])
    mask = t([[0, 1, 1, 0], [0, 0, 1, 0]])
    assert sequence_logprob(lp, mask).tolist() == [-3.0, -3.0]


def test_rollout_mismatch_by_hand():
    from realign.algorithms.mismatch import rollout_mismatch

    # one row: prompt 2 tokens, 3 response tokens (positions 1, 2, 3 of 5)
    batch = {"tokens": torch.zeros(1, 6, dtype=torch.long), "lengths": torch.tensor([5]),
             "prompt_lengths": torch.tensor([2]),
             "logprobs": torch.tensor([[9.0, -1.0, -2.0, -3.0, 9.0]]),
             "prox_logprobs": torch.tensor([[0.0, -1.0, -2.02, -2.5, 0.0]])}
    m = rollout_mismatch(batch, threshold=0.01)
    assert m["rollout_logprob_diff_mean"] == pytest.approx((0 + 0.02 + 0.5) / 3, rel=1e-5)
    assert m["rollout_logprob_diff_max"] == pytest.approx(0.5)
    assert m["rollout_logprob_diff_frac"] == pytest.approx(2 / 3)
    assert rollout_mismatch({k: v for k, v in batch.items() if k != "prox_logprobs"}, 0.01) == {}
