"""DAPO against hand-computed values: each side of the decoupled clip, the token-level
loss (exact over micro-batches), dynamic sampling (drop, fill, surplus) and the
overlong reward shaping."""
from __future__ import annotations

import math

import pytest
import torch

from realign.algorithms import dapo
from realign.algorithms.common import minibatch, pop_stats
from realign.algorithms.params import DAPOConfig
from realign.algorithms.selection import keep_informative
from realign.errors import UserError

pytestmark = pytest.mark.torch

SQ = 1 / math.sqrt(2)      # a two-sample group's normalised advantage


def t(x):
    return torch.tensor(x, dtype=torch.float32)


def cfg(**kw) -> DAPOConfig:
    base = dict(samples_per_prompt=2, prompts_per_step=1, gen_len=4)
    return DAPOConfig(**{**base, **kw})


def one_row(ratios, advantages):
    """One sequence whose response tokens have these ratios and advantages, as the
    train call hands it to the loss (a mini-batch of that one row)."""
    n = len(ratios)
    batch = {"tokens": torch.zeros(1, n + 2, dtype=torch.long),
             "lengths": torch.tensor([n + 2]), "prompt_lengths": torch.tensor([1]),
             "logprobs": torch.zeros(1, n + 1), "advantages": t([[0.0] + advantages]),
             "loss_mask": t([[0.0] + [1.0] * n])}
    new = torch.log(t([[1.0] + ratios])).requires_grad_()
    return new, minibatch(batch, 0, 1)


# ---- the clip, side by side -------------------------------------------------------

RATIOS = [0.7, 1.3, 1.3, 1.1, 1.25]
ADV = [-1.0, 1.0, -1.0, 1.0, 1.0]


def test_clip_higher_by_hand():
    # eps_low 0.2, eps_high 0.28, per token -min(r A, clip(r) A):
    # 0.7, A -1: clip 0.8 binds (low side) -> 0.8, no gradient
    # 1.3, A +1: clip 1.28 binds (high side) -> -1.28, no gradient
    # 1.3, A -1: a grown ratio with a negative advantage is not clipped -> 1.3
    # 1.1, A +1: inside -> -1.1
    # 1.25, A +1: inside 1.28 (a symmetric 0.2 clip would stop it at 1.2) -> -1.25
    new, batch = one_row(RATIOS, ADV)
    loss, m = dapo.actor_loss(new, batch, cfg())
    assert loss.item() == pytest.approx((0.8 - 1.28 + 1.3 - 1.1 - 1.25) / 5)
    assert m["clip_frac_low"].item() == pytest.approx(1 / 5)
    assert m["clip_frac_high"].item() == pytest.approx(1 / 5)
    assert m["clip_frac"].item() == pytest.approx(2 / 5)
    loss.backward()
    # d/dlog r of -r A / 5 = -r A / 5 where not clipped
    assert new.grad[0, 1:].tolist() == pytest.approx([0, 0, 1.3 / 5, -1.1 / 5, -1.25 / 5])


def test_symmetric_clip_stops_the_token_clip_higher_lets_grow():
    new, batch = one_row(RATIOS, ADV)
    loss, m = dapo.actor_loss(new, batch, cfg(clip_ratio_high=0.2))
    assert loss.item() == pytest.approx((0.8 - 1.2 + 1.3 - 1.1 - 1.2) / 5)
    assert m["clip_frac_high"].item() == pytest.approx(2 / 5)
    loss.backward()
    assert new.grad[0, 1:].tolist() == pytest.approx([0, 0, 1.3 / 5, -1.1 / 5, 0])


# ---- token-level loss --------------------------------------------------------------

def _four_rows(loss_per_token):
    """4 rows with 1, 1, 3, 3 response tokens; the surrogate of each token is
    ``-A`` (ratio 1), so a row's advantage sets its per-token loss."""
    lengths = torch.tensor([3, 3, 5, 5])
    batch = {"tokens": torch.zeros(4, 6, dtype=torch.long), "lengths": lengths,
             "prompt_lengths": torch.tensor([2, 2, 2, 2]), "logprobs": torch.zeros(4, 5)}
    mask = (torch.arange(5).unsqueeze(0) >= 1) & (torch.arange(5).unsqueeze(0) < lengths.unsqueeze(1) - 1)
    batch["loss_mask"] = mask.float()
    batch["advantages"] = -t(loss_per_token).unsqueeze(1) * batch["loss_mask"]
    return batch


def test_token_level_mean_is_exact_over_micro_batches():
    """Loss 2 on each token of rows 0-1 (1 token each), 1 on rows 2-3 (3 each): the
    mini-batch's token mean is (2 + 2 + 3 + 3) / 8 = 1.25. Split in 2 micro-batches
    (the engine averages their losses) it stays 1.25; a token mean per micro-batch
    would give (2 + 1) / 2 = 1.5, a mean of sequence means (2 + 2 + 1 + 1) / 4 = 1.5."""
    batch = minibatch(_four_rows([2, 2, 1, 1]), 0, 1)
    new = torch.zeros(4, 5, requires_grad=True)
    whole, _ = dapo.actor_loss(new, batch, cfg())
    halves = [dapo.actor_loss(new[sl], {k: v[sl] for k, v in batch.items()}, cfg())[0]
              for sl in (slice(0, 2), slice(2, 4))]
    assert whole.item() == pytest.approx(1.25)
    assert (sum(halves) / 2).item() == pytest.approx(1.25)
    # the same gradient in either split: d(-r A / 8)/d log r = -A / 8 on every token
    g_whole = torch.autograd.grad(whole, new)[0]
    g_split = torch.autograd.grad(sum(halves) / 2, new)[0]
    torch.testing.assert_close(g_whole, g_split)
    assert g_whole[2, 1:4].tolist() == pytest.approx([1 / 8] * 3)
    assert g_whole[0, 1].item() == pytest.approx(2 / 8)


def test_the_loss_needs_the_mini_batch_totals():
    batch = _four_rows([1, 1, 1, 1])
    with pytest.raises(UserError, match="minibatch_rows"):
        dapo.actor_loss(torch.zeros(4, 5), batch, cfg())


# ---- dynamic sampling ----------------------------------------------------------------

def test_keep_informative_by_hand():
    # groups of 3: [1 1 1] constant, [0 1 0], [0 0 0] constant, [1 0 0]
    r = t([1, 1, 1, 0, 1, 0, 0, 0, 0, 1, 0, 0])
    k = keep_informative(r, 3, 2, "g")
    assert k.rows.tolist() == [3, 4, 5, 9, 10, 11]
    assert (k.dropped, k.shortfall, k.surplus) == (2, 0, 0)
    assert not k.filler.any()
    # three wanted, two informative: the first constant group fills, flagged
    k = keep_informative(r, 3, 3, "g")
    assert k.rows.tolist() == [3, 4, 5, 9, 10, 11, 0, 1, 2]
    assert k.filler.tolist() == [False] * 6 + [True] * 3
    assert (k.dropped, k.shortfall, k.surplus) == (2, 1, 0)
    # one wanted: the second informative group is generated for nothing
    k = keep_informative(r, 3, 1, "g")
    assert k.rows.tolist() == [3, 4, 5] and k.surplus == 1


def _rollout(rewards, response_lens, prompt_len=2):
    b = len(rewards)
    lengths = torch.tensor(response_lens) + prompt_len
    return {"tokens": torch.zeros(b, int(lengths.max()), dtype=torch.long), "lengths": lengths,
            "prompt_lengths": torch.full((b,), prompt_len), "rewards": t(rewards),
            "logprobs": torch.zeros(b, int(lengths.max()) - 1),
            "policy_version": torch.arange(b)}


def test_prepare_drops_constant_groups_and_trains_the_wanted():
    # 2 trained of 3 generated (share 1/3: ceil(2 / (2/3)) = 3); group 0 constant
    raw = _rollout([1, 1, 0, 1, 1, 0], [2, 2, 2, 2, 2, 2])
    c = cfg(prompts_per_step=2, dropped_group_frac=1 / 3, overlong_buffer_frac=0.0)
    out, stats = pop_stats(dapo.prepare(raw, c))
    assert out["policy_version"].tolist() == [2, 3, 4, 5]     # every per-row value follows
    assert out["advantages"][:, 1].tolist() == pytest.approx([-SQ, SQ, SQ, -SQ], abs=1e-5)
    assert out["loss_mask"].sum(1).tolist() == [2, 2, 2, 2]
    assert stats == pytest.approx({"dropped_group_frac": 1 / 3, "shortfall_frac": 0.0,
                                   "surplus_groups": 0.0, "generated_per_trained": 1.5,
                                   "overlong_frac": 0.0})


def test_prepare_fills_a_shortfall_with_weightless_groups():
    raw = _rollout([1, 1, 0, 1, 0, 0], [2, 2, 2, 2, 2, 2])
    c = cfg(prompts_per_step=2, dropped_group_frac=1 / 3, overlong_buffer_frac=0.0)
    out, stats = pop_stats(dapo.prepare(raw, c))
    assert out["policy_version"].tolist() == [2, 3, 0, 1]     # informative first, then filler
    assert out["loss_mask"].sum(1).tolist() == [2, 2, 0, 0]
    assert out["advantages"][2:].abs().sum() == 0
    assert stats["shortfall_frac"] == 0.5 and stats["dropped_group_frac"] == pytest.approx(2 / 3)


def test_without_dynamic_sampling_every_group_trains():
    raw = _rollout([1, 1, 0, 1], [2, 2, 2, 2])
    out, _ = pop_stats(dapo.prepare(raw, cfg(prompts_per_step=2, dynamic_sampling=False,
                                             overlong_buffer_frac=0.0)))
    assert out["policy_version"].tolist() == [0, 1, 2, 3]
    assert out["loss_mask"].sum() == 8


def test_a_batch_sampled_in_rounds_is_the_trained_groups_with_their_fillers():
    # the rounds kept one informative group (1, 0) and reserved a constant one (0, 0)
    raw = _rollout([1, 0, 0, 0], [2, 2, 2, 2])
    c = cfg(prompts_per_step=2, dropped_group_frac=0.5, max_sampling_rounds=3,
            overlong_buffer_frac=0.0)
    out, stats = pop_stats(dapo.prepare(raw, c))
    assert out["policy_version"].tolist() == [0, 1, 2, 3]
    assert out["loss_mask"].sum(1).tolist() == [2, 2, 0, 0]
    # what was dropped and generated comes from the rounds (realign.worker.sampling_loop)
    assert stats == {"shortfall_frac": 0.5, "overlong_frac": 0.0}
    with pytest.raises(UserError, match="holds 3 prompts' groups, the batch shape says 2"):
        dapo.prepare(_rollout([1, 0] * 3, [2] * 6), c)


def test_the_batch_must_be_the_shape_generated_for():
    raw = _rollout([1, 0, 0, 1], [2, 2, 2, 2])
    with pytest.raises(UserError, match="holds 2 prompts' groups, the batch shape says 3"):
        dapo.prepare(raw, cfg(prompts_per_step=2, dropped_group_frac=1 / 3))


# ---- overlong shaping ----------------------------------------------------------------

def test_overlong_shaping_by_hand():
    lens = torch.tensor([10, 16, 17, 18, 20])
    assert dapo.overlong_shaping(lens, 20, 4, 1.0).tolist() == [0, 0, -0.25, -0.5, -1]
    assert dapo.overlong_shaping(lens, 20, 4, 0.5).tolist() == [0, 0, -0.125, -0.25, -0.5]
    assert dapo.overlong_shaping(lens, 20, 0, 1.0).tolist() == [0] * 5


def test_shaping_enters_the_advantage_but_not_the_drop():
    # gen_len 4, buffer 0.5 * 4 = 2 tokens, penalty 0.5: length 4 -> -0.5, 3 -> -0.25
    # group 0: rewards 1, 0.8 with lengths 4, 2 -> shaped 0.5, 0.8: the shorter wins
    # group 1: rewards 1, 1 (constant) with lengths 4, 2 -> dropped though the shaped
    #          rewards differ (DAPO drops on the answer's reward, not its length)
    raw = _rollout([1, 0.8, 1, 1], [4, 2, 4, 2])
    c = cfg(prompts_per_step=1, dropped_group_frac=0.5, overlong_buffer_frac=0.5,
            overlong_penalty=0.5)
    out, stats = pop_stats(dapo.prepare(raw, c))
    assert out["rewards"].tolist() == pytest.approx([1, 0.8])
    assert out["advantages"][:, 1].tolist() == pytest.approx([-SQ, SQ], abs=1e-5)
    assert stats["overlong_frac"] == 0.5 and stats["dropped_group_frac"] == 0.5


def test_bad_values_name_their_key():
    from planner.graph.algorithms import BatchShape
    from realign.algorithms.params_table import make_params
    shape = BatchShape(samples_per_prompt=4, dropped_group_frac=0.25)
    for params, field in (({"clip_ratio_high": 0}, "algorithm.params.clip_ratio_high"),
                          ({"overlong_buffer_frac": 1.0}, "algorithm.params.overlong_buffer_frac"),
                          ({"dynamic_sampling": False}, "algorithm.params.dynamic_sampling"),
                          ({"max_sampling_rounds": 0}, "algorithm.params.max_sampling_rounds"),
                          ({"max_sampling_rounds": 65}, "algorithm.params.max_sampling_rounds"),
                          ({"max_sampling_rounds": 2.5}, "algorithm.params.max_sampling_rounds"),
                          ({"max_sampling_rounds": "many"},
                           "algorithm.params.max_sampling_rounds"),
                          ({"max_sampling_rounds": 4, "max_round_prompts": 0},
                           "algorithm.params.max_round_prompts"),
                          ({"max_sampling_rounds": 4, "max_round_prompts": 2.5},
                           "algorithm.params.max_round_prompts"),
                          ({"max_round_prompts": 60}, "algorithm.params.max_round_prompts")):
        with pytest.raises(UserError) as e:
            make_params("dapo", params, shape)
        assert e.value.field == field
    once = BatchShape(samples_per_prompt=4)
    with pytest.raises(UserError, match="samples again") as e:
        make_params("dapo", {"dynamic_sampling": False, "max_sampling_rounds": 2}, once)
    assert e.value.field == "algorithm.params.max_sampling_rounds"
    with pytest.raises(UserError, match="allowed|less than or equal") as e:
        make_params("dapo", {"max_sampling_rounds": 65}, shape)
    assert "65" in str(e.value)


def test_the_round_cap_defaults_to_first_rounds_and_needs_rounds():
    from planner.graph.algorithms import BatchShape
    from realign.algorithms.params import max_round_prompts
    from realign.algorithms.params_table import make_params
    shape = BatchShape(prompts_per_step=16, samples_per_prompt=4, dropped_group_frac=0.45)
    assert max_round_prompts(make_params("dapo", {"max_sampling_rounds": 4}, shape)) == 240
    assert max_round_prompts(make_params(
        "dapo", {"max_sampling_rounds": 4, "max_round_prompts": 100}, shape)) == 100
    assert max_round_prompts(make_params("dapo", {}, shape)) == 0
    with pytest.raises(UserError, match="max_sampling_rounds 1") as e:
        make_params("dapo", {"max_round_prompts": 100}, shape)
    assert e.value.field == "algorithm.params.max_round_prompts"
