"""Qwen3-MoE in realign's plain decoder on real gloo ranks, fp32, against transformers:
a tiny random model (realign.assets.tiny, 3 layers with the middle one dense, 8 experts of
32, top 2, head_dim 32) at TP1 and TP2 (experts split like the dense MLP, router on every
rank): logits and log-probs, the routing, megatron's forward (the same MoE module as its
MLP), the planner's logical tensors, and the HF checkpoint written back."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.cpu_dist

TOL = 1e-4


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    from realign.assets.tiny import TINY_QWEN3_MOE, make_model

    root = tmp_path_factory.mktemp("moe")
    # a router of larger weights (std 0.3): clear margins between the experts' scores,
    # so the top-k cannot flip on rounding
    arch = dict(TINY_QWEN3_MOE, initializer_range=0.3)
    return {
        "moe": str(make_model(root / "moe", "qwen3_moe", seed=11, arch=arch)),
        # every layer sparse, probabilities not renormalised
        "moe_all": str(make_model(root / "moe_all", "qwen3_moe", seed=12, arch=dict(
            arch, mlp_only_layers=[], norm_topk_prob=False, num_hidden_layers=2))),
    }


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("model", ["moe", "moe_all"])
def test_logits_and_logprobs_match_transformers(world2, moe_models, model, tp):
    got = [r for r in world2.run("cases_moe:logits_parity", moe_models[model], tp, 1)
           if r is not None]
    assert len(got) == tp
    for logits_diff, logprob_diff, sparse_layers in got:
        assert logits_diff < TOL and logprob_diff < TOL, (model, tp, logits_diff, logprob_diff)
        assert sparse_layers == 2            # transformers routed on both sparse layers


@pytest.mark.parametrize("tp", [1, 2])
def test_every_rank_routes_as_transformers(world2, moe_models, tp):
    for same, weight_diff in filter(None, world2.run("cases_moe:routing_matches",
                                                     moe_models["moe"], tp)):
        assert same and weight_diff < 1e-6


@pytest.mark.parametrize("tp", [1, 2])
def test_megatrons_forward_equals_the_decoders(world2, moe_models, tp):
    for diff in filter(lambda d: d is not None,
                       world2.run("cases_moe:megatron_matches_decoder", moe_models["moe"], tp)):
        assert diff < 5e-5, (tp, diff)


@pytest.mark.parametrize("tp", [1, 2])
def test_experts_are_the_planners_logical_tensors(world2, moe_models, tp):
    for worst, changed in filter(None, world2.run("cases_moe:logical_shards_check",
                                                  moe_models["moe"], tp)):
        assert worst == 0.0 and changed > 1e-3


def test_saved_checkpoint_loads_in_transformers_with_the_same_weights(world2, moe_models,
                                                                     tmp_path):
    """Written from TP2 (per-expert HF names, the config's MoE keys); transformers loads
    it with the same weights, and realign reads it back with the same logits."""
    import json

    out = str(tmp_path / "out")
    diff, files = world2.run("cases_model:save_roundtrip", moe_models["moe"], out, 2, 1, 1)[0]
    assert diff == 0.0 and "config.json" in files
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    src = json.loads(open(f"{moe_models['moe']}/config.json").read())
    for key in ("num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
                "norm_topk_prob", "mlp_only_layers"):
        assert cfg[key] == src[key], key
    for logits_diff, logprob_diff, _ in filter(None, world2.run("cases_moe:logits_parity",
                                                                out, 1, 1)):
        assert logits_diff < TOL and logprob_diff < TOL
