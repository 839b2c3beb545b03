"""Qwen3-MoE at PP2 on real gloo ranks, fp32: the plain decoder's logits and log-probs
against transformers', and megatron's forward (through its own pipeline schedule)
against the decoder's. Two 4-layer models: one whose first stage holds only sparse
layers and whose last stage holds only dense ones (``mlp_only_layers`` [2, 3]), one whose
first stage mixes a sparse and a dense layer (``mlp_only_layers`` [1])."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.cpu_dist

TOL = 1e-4


@pytest.fixture(scope="module")
def pp_models(tmp_path_factory):
    from realign.assets.tiny import TINY_QWEN3_MOE, make_model

    root = tmp_path_factory.mktemp("moe_pp")
    arch = dict(TINY_QWEN3_MOE, initializer_range=0.3, num_hidden_layers=4)  # clear top-k
    return {
        "split": str(make_model(root / "split", "qwen3_moe", seed=21,
                                arch=dict(arch, mlp_only_layers=[2, 3]))),
        "mixed": str(make_model(root / "mixed", "qwen3_moe", seed=22,
                                arch=dict(arch, mlp_only_layers=[1]))),
    }


@pytest.mark.parametrize("model,sparse", [("split", 2), ("mixed", 3)])
def test_pp2_logits_and_logprobs_match_transformers(world2, pp_models, model, sparse):
    got = [r for r in world2.run("cases_moe:logits_parity", pp_models[model], 1, 2)
           if r is not None]
    assert len(got) == 2                   # both stages answer (the last stage's logits)
    for logits_diff, logprob_diff, sparse_layers in got:
        assert logits_diff < TOL and logprob_diff < TOL, (model, logits_diff, logprob_diff)
        assert sparse_layers == sparse


@pytest.mark.parametrize("model", ["split", "mixed"])
def test_pp2_megatrons_forward_equals_the_decoders(world2, pp_models, model):
    diffs = [d for d in world2.run("cases_moe:megatron_schedule_matches_decoder",
                                   pp_models[model], 1, 2, 2) if d is not None]
    assert len(diffs) == 2
    for diff in diffs:
        assert diff < 5e-5, (model, diff)
