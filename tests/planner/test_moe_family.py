"""Qwen3-MoE as a model family (planner.specs.families.qwen3_moe): its config mapping,
parameter counts (all experts and the active ones), its logical tensors and presets,
and the mixtures of experts realign refuses."""
from __future__ import annotations

import json

import pytest

from planner.errors import PlanError
from planner.specs.families import FAMILIES
from planner.specs.layout import Layout, model_layout_problems
from planner.specs.model_spec import model_presets, model_spec_from_hf_config
from planner.specs.param_layout import all_tensors, stage_tensors

pytestmark = pytest.mark.pure

#: Qwen3-30B-A3B's published config.json (the keys realign reads)
QWEN3_30B_A3B = {
    "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
    "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "router_aux_loss_coef": 0.001, "max_position_embeddings": 40960, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "rope_scaling": None, "sliding_window": None,
    "use_sliding_window": False, "tie_word_embeddings": False, "vocab_size": 151936,
    "attention_bias": False, "output_router_logits": False}


def spec_of(tmp_path, cfg):
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return model_spec_from_hf_config(tmp_path)


def test_the_published_config_is_the_preset_and_has_its_sizes(tmp_path):
    spec = spec_of(tmp_path, QWEN3_30B_A3B)
    presets = model_presets()
    assert spec.model_copy(update={"name": "qwen3-30b-a3b"}) == presets["qwen3-30b-a3b"]
    moe = spec.moe
    assert (moe.n_experts, moe.top_k, moe.expert_ffn_hidden, moe.norm_topk_prob,
            moe.dense_layers, moe.router_aux_loss_coef) == (128, 8, 768, True, (), 0.001)
    assert (spec.family, spec.qk_norm, spec.kv_channels) == ("qwen3_moe", True, 128)


@pytest.mark.parametrize("name,total_b,active_b", [
    ("qwen3-30b-a3b", 30.5, 3.3), ("qwen3-235b-a22b", 235.0, 22.0)])
def test_presets_have_their_published_total_and_active_sizes(name, total_b, active_b):
    """The model cards: 30.5B total / 3.3B activated; 235B / 22B."""
    spec = model_presets()[name]
    assert spec.total_params("lm") / 1e9 == pytest.approx(total_b, rel=1e-2)
    assert spec.active_params("lm") / 1e9 == pytest.approx(active_b, rel=2e-2)


def test_total_counts_every_expert_and_active_only_top_k():
    """Hand count of the 30B-A3B: attention (q, k, v, o of 32 / 4 heads of 128) and
    norms per layer, 128 experts of 3 x 768 x 2048 and a 128 x 2048 router, untied
    embedding and head of 151936 x 2048."""
    spec = model_presets()["qwen3-30b-a3b"]
    h, d = 2048, 128
    attn = h * 32 * d + 2 * h * 4 * d + 32 * d * h + 2 * d + 2 * h
    expert = 3 * 768 * h
    layer = attn + 128 * h + 128 * expert
    outside = 2 * 151936 * h + h
    assert spec.total_params("lm") == 48 * layer + outside
    assert spec.active_params("lm") == 48 * (layer - 120 * expert) + outside
    assert spec.total_params("lm") == sum(t.numel for t in all_tensors(spec, "lm"))


def test_sparse_step_and_mlp_only_layers_choose_the_dense_layers(tmp_path):
    """Layer i is sparse unless listed in mlp_only_layers or (i + 1) % step != 0
    (transformers' Qwen3MoeDecoderLayer)."""
    cfg = {**QWEN3_30B_A3B, "num_hidden_layers": 6}
    assert spec_of(tmp_path, {**cfg, "decoder_sparse_step": 2}).moe.dense_layers == (0, 2, 4)
    spec = spec_of(tmp_path, {**cfg, "mlp_only_layers": [0, 5]})
    assert spec.moe.dense_layers == (0, 5)
    assert [spec.is_sparse(i) for i in range(6)] == [False, True, True, True, True, False]
    names = {t.name for t in stage_tensors(spec, "lm", 1, 0)}
    assert "decoder.layers.0.mlp.linear_fc1.weight" in names
    assert "decoder.layers.0.mlp.router.weight" not in names
    assert "decoder.layers.1.mlp.router.weight" in names
    assert "decoder.layers.1.mlp.experts.local_experts.127.linear_fc2.weight" in names
    assert "decoder.layers.1.mlp.linear_fc1.weight" not in names
    dense_layer = spec.layer_params(0)
    sparse_layer = spec.layer_params(1)
    assert spec.total_params("lm") == (2 * dense_layer + 4 * sparse_layer
                                       + 2 * 151936 * 2048 + 2048)
    assert spec.layer_params() == sparse_layer            # the heaviest layer


def test_experts_split_by_tp_like_the_dense_mlp_and_the_router_is_whole():
    spec = model_presets()["qwen3-30b-a3b"]
    by = {t.name: t for t in stage_tensors(spec, "lm", 2, 1)}
    fc1 = by["decoder.layers.24.mlp.experts.local_experts.3.linear_fc1.weight"]
    assert (fc1.shape, fc1.shard_dim, fc1.parts, fc1.content) == (
        (1536, 2048), 0, 2, "decoder.layers.24.experts.3.expert_fc1")
    assert fc1.shard_ranges(1, 4) == [(192, 384), (960, 1152)]     # gate and up rows
    fc2 = by["decoder.layers.24.mlp.experts.local_experts.3.linear_fc2.weight"]
    assert (fc2.shape, fc2.shard_dim) == ((2048, 768), 1)
    router = by["decoder.layers.24.mlp.router.weight"]
    assert (router.shape, router.shard_dim) == ((128, 2048), None)
    assert model_layout_problems(Layout(tp=4, pp=1, dp=1), spec) == []
    odd = spec.model_copy(update={"moe": spec.moe.model_copy(update={"expert_ffn_hidden": 102})})
    assert "must divide the experts' ffn hidden 102" in model_layout_problems(
        Layout(tp=4, pp=1, dp=1), odd)[0]


def test_family_names_each_expert_and_the_router():
    fam = FAMILIES["qwen3_moe"]
    assert fam.layer_names("router") == ("mlp.gate.weight",)
    assert fam.layer_names("expert_fc1", expert=5) == (
        "mlp.experts.5.gate_proj.weight", "mlp.experts.5.up_proj.weight")
    assert fam.layer_names("expert_fc2", expert=0) == ("mlp.experts.0.down_proj.weight",)
    assert fam.layer_names("q_norm") == ("self_attn.q_norm.weight",)


def test_transformers_spelling_num_local_experts_is_read(tmp_path):
    cfg = {k: v for k, v in QWEN3_30B_A3B.items() if k != "num_experts"}
    assert spec_of(tmp_path, {**cfg, "num_local_experts": 64}).moe.n_experts == 64


@pytest.mark.parametrize("change,says", [
    ({"num_experts_per_tok": 129}, "num_experts_per_tok (129) must be at most num_experts (128)"),
    ({"num_experts_per_tok": 0}, "num_experts_per_tok must be a positive whole number"),
    ({"moe_intermediate_size": None}, "moe_intermediate_size must be a positive whole number"),
    ({"mlp_only_layers": [48]}, "mlp_only_layers names layer 48, outside 0..47"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step must be a positive whole number"),
    ({"shared_expert_intermediate_size": 4096}, "shared experts are not part of qwen3_moe"),
    ({"model_type": "deepseek_v3"}, "model_type 'deepseek_v3' is not supported (allowed: "
                                    "llama, mistral, qwen2, qwen3, qwen3_moe)"),
    ({"model_type": "gpt_oss"}, "model_type 'gpt_oss' is not supported"),
    ({"model_type": "mixtral"}, "model_type 'mixtral' is not supported"),
    ({"model_type": "qwen2_moe"}, "model_type 'qwen2_moe' is not supported"),
    ({"model_type": "qwen3"}, "a mixture of experts (128 experts) is not supported in "
                              "model_type 'qwen3'"),
])
def test_what_realign_does_not_run_is_refused_naming_it(tmp_path, change, says):
    with pytest.raises(PlanError) as e:
        spec_of(tmp_path, {**QWEN3_30B_A3B, **change})
    assert says in e.value.message and e.value.field == "model"
    assert str(tmp_path / "config.json") in e.value.message


def test_a_spec_without_experts_in_the_moe_family_is_refused():
    spec = model_presets()["qwen3-30b-a3b"]
    with pytest.raises(PlanError, match="is a mixture of experts: give moe"):
        spec.model_validate({**spec.model_dump(), "moe": None})
    with pytest.raises(PlanError, match="has no experts: leave moe out"):
        spec.model_validate({**spec.model_dump(), "family": "qwen3"})
