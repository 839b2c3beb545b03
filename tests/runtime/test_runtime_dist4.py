"""TP and PP (and DP) together: a 4-rank gloo world, started once for this module."""
from __future__ import annotations

import pytest

pytestmark = [pytest.mark.cpu_dist, pytest.mark.slow]

TOL = 1e-4


@pytest.fixture(scope="module")
def world4():
    from realign.runtime.local_world import LocalWorld

    with LocalWorld(4, timeout_s=240) as w:
        yield w


@pytest.mark.parametrize("tp,pp,dp", [(2, 2, 1), (2, 1, 2)])
def test_logits_and_greedy_generation(world4, tiny_models, tp, pp, dp):
    path = tiny_models["llama_tied"]
    for logits_diff, logprob_diff in world4.run("cases_model:logits_parity", path, tp, pp, dp):
        assert logits_diff < TOL and logprob_diff < TOL
    ref = world4.run("cases_generate:hf_greedy", path, 6)[0]
    for tokens, _, _ in world4.run("cases_generate:generate", path, tp, pp, dp,
                                   {"max_new_tokens": 6, "greedy": True}):
        assert tokens == ref


@pytest.mark.parametrize("tp,pp,dp,waves", [(1, 4, 1, 4), (1, 4, 1, 2), (2, 2, 1, 4)])
def test_waves_pipelined_over_deep_pipelines_equal_transformers(world4, tiny_models, tp, pp,
                                                                dp, waves):
    """Waves in flight over 2 and 4 stages (fewer waves than stages too): middle stages
    learn each wave's tokens from the last stage, and greedy decoding is transformers'."""
    from cases_generate import PROMPTS

    path = tiny_models["llama_tied"]
    prompts = PROMPTS * 2
    ref = world4.run("cases_generate:hf_greedy", path, 6, prompts)[0]
    for tokens, _, lengths in world4.run("cases_generate:generate", path, tp, pp, dp,
                                         {"max_new_tokens": 6, "greedy": True}, prompts, waves):
        assert tokens == ref and lengths == [6] * len(prompts)


@pytest.mark.parametrize("forward", ["plain", "megatron"])
def test_train_step_tp2_pp2(world4, tiny_models, forward):
    import pytest as pt
    path = tiny_models["qwen2"]
    ref_hist, ref_out = world4.run("cases_train:reference", path, "lm", 2, 2)[0]
    for hist, out in world4.run("cases_train:train", path, "lm", 2, 2, 1, 2, 2, True,
                                forward):
        for step, (got, want) in enumerate(zip(hist, ref_hist)):
            rel = 1e-5 if step == 0 else 1e-3
            assert got["loss"] == pt.approx(want["loss"], rel=rel)
            assert got["grad_norm"] == pt.approx(want["grad_norm"], rel=rel)
        assert float((out - ref_out).abs().max()) < 2e-3
