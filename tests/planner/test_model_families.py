"""Model families from their config.json (planner.specs.families): the config mapping
of each family, what is refused and why, and the presets of LLaMA 3.1/3.2 and Qwen3
against their published sizes."""
from __future__ import annotations

import json

import pytest

from planner.errors import PlanError
from planner.specs.families import FAMILIES
from planner.specs.model_spec import model_presets, model_spec_from_hf_config

pytestmark = pytest.mark.pure

LLAMA31_8B = {
    "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "max_position_embeddings": 131072, "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "tie_word_embeddings": False, "vocab_size": 128256, "attention_bias": False,
    "mlp_bias": False}
QWEN3_06B = {
    "model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 3072,
    "max_position_embeddings": 40960, "max_window_layers": 28, "num_attention_heads": 16,
    "num_hidden_layers": 28, "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000, "rope_scaling": None, "sliding_window": None,
    "use_sliding_window": False, "tie_word_embeddings": True, "vocab_size": 151936,
    "attention_bias": False}


def spec_of(tmp_path, cfg):
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return model_spec_from_hf_config(tmp_path)


def test_llama31_and_qwen3_configs_map_onto_their_presets(tmp_path):
    presets = model_presets()
    for cfg, preset in ((LLAMA31_8B, "llama3.1-8b"), (QWEN3_06B, "qwen3-0.6b")):
        spec = spec_of(tmp_path, cfg)
        assert spec.model_copy(update={"name": preset}) == presets[preset], preset
    q = presets["qwen3-0.6b"]
    assert (q.family, q.qk_norm, q.qkv_bias, q.kv_channels, q.tied_embeddings) == (
        "qwen3", True, False, 128, True)
    assert q.kv_channels * q.n_heads != q.hidden          # 16 x 128 = 2048, hidden 1024
    rs = presets["llama3.1-8b"].rope_scaling
    assert (rs.rope_type, rs.factor, rs.original_max_position_embeddings) == ("llama3", 8.0, 8192)


@pytest.mark.parametrize("name,billions", [
    ("llama3.1-8b", 8.03), ("llama3.1-70b", 70.6), ("llama3.1-405b", 405.9),
    ("llama3.2-1b", 1.24), ("llama3.2-3b", 3.21), ("qwen3-0.6b", 0.60), ("qwen3-1.7b", 1.72),
    ("qwen3-4b", 4.02), ("qwen3-8b", 8.19), ("qwen3-14b", 14.77), ("qwen3-32b", 32.76)])
def test_presets_have_their_published_sizes(name, billions):
    """Parameter counts of the model cards, to their precision (Qwen3-0.6B: 0.596)."""
    assert model_presets()[name].total_params("lm") / 1e9 == pytest.approx(billions, rel=1e-2)


@pytest.mark.parametrize("change,says", [
    ({"model_type": "gpt_neox"}, "model_type 'gpt_neox' is not supported (allowed: "
                                 "llama, mistral, qwen2, qwen3, qwen3_moe)"),
    ({"num_experts": 64}, "a mixture of experts (64 experts) is not supported"),
    ({"num_local_experts": 8}, "a mixture of experts (8 experts) is not supported"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}},
     "rope_type 'longrope' is not supported (allowed: default, linear, llama3, yarn)"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "llama3 needs low_freq_factor"),
    ({"use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 14},
     "a sliding window on the first 14 of 28 layers only"),
    ({"use_sliding_window": True, "sliding_window": 4096,
      "layer_types": ["sliding_attention", "full_attention"] * 14},
     "layer_types mixes full_attention, sliding_attention"),
    ({"mlp_bias": True}, "mlp_bias=true is not supported"),
])
def test_what_realign_does_not_run_is_refused_naming_it(tmp_path, change, says):
    with pytest.raises(PlanError) as e:
        spec_of(tmp_path, {**QWEN3_06B, **change})
    assert says in e.value.message and e.value.field == "model"
    assert str(tmp_path / "config.json") in e.value.message


def test_a_uniform_window_caps_the_sequence_and_every_family_has_its_module(tmp_path):
    spec = spec_of(tmp_path, {**QWEN3_06B, "use_sliding_window": True, "sliding_window": 4096,
                              "max_window_layers": 28})
    assert spec.max_seq_len == 4096
    assert set(FAMILIES) == {"llama", "mistral", "qwen2", "qwen3", "qwen3_moe"}
    assert FAMILIES["qwen3"].layer_names("q_norm") == ("self_attn.q_norm.weight",)
    assert FAMILIES["llama"].layer_names("fc1") == ("mlp.gate_proj.weight", "mlp.up_proj.weight")
