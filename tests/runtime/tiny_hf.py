"""Tiny random Hugging Face models for the runtime tests (no model hub)."""
from __future__ import annotations

from pathlib import Path

import torch

TINY = dict(vocab_size=200, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            initializer_range=0.3, rms_norm_eps=1e-6)


def make_tiny(path: str | Path, kind: str = "llama", head: str = "lm", tied: bool = False,
              seed: int = 0, **overrides) -> Path:
    """Save a tiny random ``kind`` (llama | qwen2 | qwen3 | mistral) model with an LM head
    or a one-label sequence-classification (value) head into ``path``; returns the path."""
    import transformers as tf

    cfg_cls = {"llama": tf.LlamaConfig, "qwen2": tf.Qwen2Config, "qwen3": tf.Qwen3Config,
               "mistral": tf.MistralConfig}[kind]
    fields = dict(TINY, tie_word_embeddings=tied, **overrides)
    if kind == "qwen2":
        fields.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": 1e6})
    cfg = cfg_cls(**fields)
    if head == "value":
        cfg.num_labels = 1
        cfg.pad_token_id = 0
    torch.manual_seed(seed)
    model_cls = {("llama", "lm"): tf.LlamaForCausalLM, ("qwen2", "lm"): tf.Qwen2ForCausalLM,
                 ("mistral", "lm"): tf.MistralForCausalLM, ("qwen3", "lm"): tf.Qwen3ForCausalLM,
                 ("qwen3", "value"): tf.Qwen3ForSequenceClassification,
                 ("llama", "value"): tf.LlamaForSequenceClassification,
                 ("qwen2", "value"): tf.Qwen2ForSequenceClassification,
                 ("mistral", "value"): tf.MistralForSequenceClassification}[(kind, head)]
    model = model_cls(cfg)
    # random (not zero) biases, so the QKV-bias mapping is exercised
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or name.endswith("norm.weight") or "layernorm" in name:
                p.normal_(1.0 if "norm" in name else 0.0, 0.2)
    model.save_pretrained(str(path))
    return Path(path)


def hf_model(path: str | Path):
    import transformers as tf

    cfg = tf.AutoConfig.from_pretrained(str(path))
    arch = cfg.architectures[0]
    model = getattr(tf, arch).from_pretrained(str(path), dtype=torch.float32)
    return model.eval()
