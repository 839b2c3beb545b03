"""The families realign adds beyond LLaMA 2/3, Qwen2 and Mistral, against transformers
in fp32 on real gloo ranks: LLaMA 3.1's rope scaling (``llama3``; and ``yarn``,
``linear``, which the same code computes) with prompts and generations past the
original window, and Qwen3 (per-head q/k norms, an explicit head_dim, tied embeddings),
at TP1, TP2 and PP2: logits and log-probs, megatron's forward against the decoder's,
greedy generation, a value head, the planner's logical tensors, and the HF checkpoint
written back (transformers loads it with the same weights)."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.cpu_dist

TOL = 1e-4
FAMILIES = ("llama31", "qwen3", "llama_yarn", "llama_linear")
LAYOUTS = [(1, 1), (2, 1), (1, 2)]


@pytest.mark.parametrize("tp,pp", LAYOUTS)
@pytest.mark.parametrize("model", FAMILIES)
def test_logits_and_logprobs_match_transformers(world2, tiny_models, model, tp, pp):
    got = [r for r in world2.run("cases_model:logits_parity", tiny_models[model], tp, pp, 1)
           if r is not None]
    assert len(got) == (2 if tp * pp == 2 else 1)
    for logits_diff, logprob_diff in got:
        assert logits_diff < TOL and logprob_diff < TOL, (model, logits_diff, logprob_diff)


@pytest.mark.parametrize("model,head,tp,pp,micro", [
    ("llama31", "lm", 2, 1, 2), ("llama31", "lm", 1, 2, 2), ("llama_yarn", "lm", 2, 1, 1),
    ("qwen3", "lm", 2, 1, 2), ("qwen3", "lm", 1, 2, 2), ("qwen3_rm", "value", 1, 2, 2)])
def test_megatrons_forward_equals_the_decoders(world2, tiny_models, model, head, tp, pp, micro):
    """Training runs megatron's layers (q/k layernorm, the replaced RoPE frequencies, the
    softmax scale); scoring and generation the decoder's: they must agree to fp32
    rounding (log-probs of -5 to -10 here; 1.5e-5 seen at PP2: a ratio of 1 +- 2e-5)."""
    for diff in world2.run("cases_model:scoring_matches_megatron_forward", tiny_models[model],
                           head, tp, pp, micro):
        if diff is not None:
            assert diff < 5e-5, (model, diff)


@pytest.mark.parametrize("tp,pp", LAYOUTS)
@pytest.mark.parametrize("model", ["llama31", "qwen3", "llama_yarn"])
def test_greedy_generation_equals_transformers_past_the_window(world2, tiny_models, model,
                                                              tp, pp):
    """8 new tokens after prompts of up to 8: positions up to 16, twice the original
    window of the scaled models."""
    path = tiny_models[model]
    ref = world2.run("cases_generate:hf_greedy", path, 8)[0]
    for r in world2.run("cases_generate:generate", path, tp, pp, 1,
                        {"max_new_tokens": 8, "greedy": True}):
        if r is not None:
            tokens, _, lengths = r
            assert tokens == ref and lengths == [8] * 4, model


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_qwen3_value_head_matches_transformers_classifier(world2, tiny_models, tp, pp):
    for values_diff, scores_diff in world2.run("cases_model:reward_parity",
                                               tiny_models["qwen3_rm"], tp, pp, 1):
        assert values_diff < TOL and scores_diff < TOL


@pytest.mark.parametrize("model,head,tp,pp", [("qwen3", "lm", 2, 1), ("qwen3", "lm", 1, 2),
                                              ("qwen3_rm", "value", 2, 1),
                                              ("llama31", "lm", 1, 2)])
def test_logical_shards_are_the_planners_tensors(world2, tiny_models, model, head, tp, pp):
    for worst, changed in world2.run("cases_model:logical_shards_check", tiny_models[model],
                                     head, tp, pp, 1):
        assert worst == 0.0 and changed > 1e-3


@pytest.mark.parametrize("src,tp,pp", [("qwen3", 2, 1), ("qwen3", 1, 2), ("llama31", 1, 2)])
def test_saved_checkpoint_loads_in_transformers_with_the_same_weights(world2, tiny_models,
                                                                     tmp_path, src, tp, pp):
    out = str(tmp_path / "out")
    diff, files = world2.run("cases_model:save_roundtrip", tiny_models[src], out, tp, pp, 1)[0]
    assert diff == 0.0 and "config.json" in files
    for logits_diff, logprob_diff in world2.run("cases_model:logits_parity", out, 2, 1, 1):
        assert logits_diff < TOL and logprob_diff < TOL
