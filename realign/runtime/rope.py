"""RoPE frequencies of a model, scaled as its checkpoint says (``rope_scaling``:
linear, llama3, yarn), computed by transformers' own functions so that they are the
checkpoint's to the last bit; megatron-core's RotaryEmbedding then uses them (its
``inv_freq`` is replaced), in its forward and in the decoder's.

A scaling's attention factor (yarn's, 0.1 ln(factor) + 1 by default) multiplies the
cosines and sines of queries and keys alike, so the attention logits by its square:
realign folds it into the softmax scale (``TransformerConfig.softmax_scale``), which
both forwards read. Why not megatron-core's own scalings: its llama3 scaling fixes the
low/high frequency factors and the original window (8192), its linear one exists, its
yarn one lives in a separate embedding class for multi-latent attention only.
"""
from __future__ import annotations

import torch

from planner.specs.model_spec import ModelSpec


def _hf_config(spec: ModelSpec):
    """A transformers config carrying the numbers the rope functions read."""
    from transformers import LlamaConfig

    assert spec.rope_scaling is not None
    rope = {"rope_theta": spec.rope_theta,
            **spec.rope_scaling.model_dump(exclude_none=True)}
    return LlamaConfig(hidden_size=spec.hidden, num_attention_heads=spec.n_heads,
                       num_key_value_heads=spec.n_kv_heads, head_dim=spec.kv_channels,
                       max_position_embeddings=spec.max_seq_len, rope_parameters=rope)


def scaled_rope(spec: ModelSpec, device: torch.device | str = "cpu"
                ) -> tuple[torch.Tensor, float] | None:
    """(inverse frequencies [kv_channels / 2] in fp32, attention factor) of a model with
    a rope scaling; None for plain RoPE (megatron-core's own frequencies are it)."""
    if spec.rope_scaling is None:
        return None
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[spec.rope_scaling.rope_type](
        _hf_config(spec), torch.device(device))
    return inv_freq.float(), float(attention_factor)


def softmax_scale(spec: ModelSpec) -> float | None:
    """The attention's softmax scale when a rope scaling changes it (yarn's attention
    factor squared over sqrt(head dim)); None: the usual 1 / sqrt(head dim)."""
    rope = scaled_rope(spec)
    if rope is None or rope[1] == 1.0:
        return None
    return rope[1] ** 2 / spec.kv_channels ** 0.5
