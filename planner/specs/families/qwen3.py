"""Qwen3 dense (``model_type: qwen3``, 0.6B-32B): LLaMA's decoder with a per-head RMSNorm
on queries and keys (``q_norm``, ``k_norm``, over the head dimension, before RoPE), no
QKV bias, and ``head_dim`` given explicitly (Qwen3-0.6B: hidden 1024, 16 heads of 128);
the small checkpoints tie the embeddings. In megatron-core these are the
``q_layernorm`` / ``k_layernorm`` of ``qk_layernorm``."""
from planner.specs.families.base import DecoderFamily

FAMILY = DecoderFamily(
    model_type="qwen3", causal_lm="Qwen3ForCausalLM",
    classifier="Qwen3ForSequenceClassification", qk_norm=True,
    extra_layer_names={"q_norm": ("self_attn.q_norm.weight",),
                       "k_norm": ("self_attn.k_norm.weight",)})
