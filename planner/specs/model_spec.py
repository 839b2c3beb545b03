"""ModelSpec: architecture numbers of a LLaMA-family decoder, and its parameter counts.

Only numbers live here (no weights): layers, hidden size, heads, KV heads (grouped
query attention), FFN size (SwiGLU), vocabulary, tied embeddings, QKV bias. Presets
come from ``planner/presets/models.json``; a Hugging Face ``config.json`` is read by
:func:`model_spec_from_hf_config`.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from planner.errors import PlanError, from_validation

#: Megatron pads the vocabulary; realign pads to a multiple of this for every layout,
#: so the padded size does not depend on TP (any TP that divides 128 works).
VOCAB_PAD_MULTIPLE = 128


class RopeScaling(BaseModel):
    """RoPE scaled beyond the pretraining window (a config.json's ``rope_scaling`` or
    ``rope_parameters``): the type and the numbers it reads. The frequencies are
    computed as transformers computes them (realign.runtime.rope)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rope_type: Literal["linear", "llama3", "yarn"] = Field(
        description="linear (positions divided by factor) | llama3 (LLaMA 3.1+: low and "
        "high frequencies treated apart) | yarn (frequency ramp and attention factor).")
    factor: float = Field(gt=0, description="How many times the pretraining window.")
    original_max_position_embeddings: int | None = Field(
        None, gt=0, description="The pretraining window (llama3, yarn).")
    low_freq_factor: float | None = Field(None, gt=0, description="llama3.")
    high_freq_factor: float | None = Field(None, gt=0, description="llama3.")
    beta_fast: float | None = Field(None, gt=0, description="yarn.")
    beta_slow: float | None = Field(None, gt=0, description="yarn.")
    attention_factor: float | None = Field(None, gt=0, description="yarn: scales the "
                                           "attention logits' square root.")
    mscale: float | None = Field(None, description="yarn (DeepSeek form).")
    mscale_all_dim: float | None = Field(None, description="yarn (DeepSeek form).")
    truncate: bool | None = Field(None, description="yarn: truncate the correction range.")

    @model_validator(mode="after")
    def _check(self) -> "RopeScaling":
        if self.rope_type == "llama3" and None in (self.low_freq_factor, self.high_freq_factor,
                                                   self.original_max_position_embeddings):
            raise PlanError("rope_type llama3 needs low_freq_factor, high_freq_factor and "
                            "original_max_position_embeddings", field="model")
        return self


class ModelSpec(BaseModel):
    """Architecture of a dense decoder-only transformer of a supported family
    (:mod:`planner.specs.families`: LLaMA, Mistral, Qwen2, Qwen3)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="Preset or user name, used in plans and reports.")
    family: str = Field("llama", description="config.json's model_type: llama | mistral | "
                        "qwen2 | qwen3 (its weight names and forward options).")
    n_layers: int = Field(gt=0, description="Number of transformer layers.")
    hidden: int = Field(gt=0, description="Hidden size (model width).")
    n_heads: int = Field(gt=0, description="Attention (query) heads.")
    n_kv_heads: int = Field(gt=0, description="Key/value heads (= n_heads without GQA).")
    ffn_hidden: int = Field(gt=0, description="SwiGLU intermediate size.")
    vocab_size: int = Field(gt=0, description="Tokenizer vocabulary size (unpadded).")
    tied_embeddings: bool = Field(False, description="Output layer shares the embedding.")
    qkv_bias: bool = Field(False, description="QKV projection has a bias (Qwen2).")
    qk_norm: bool = Field(False, description="Per-head RMSNorm on queries and keys before "
                          "RoPE (Qwen3).")
    head_dim: int | None = Field(None, description="Per-head size; default hidden // n_heads.")
    max_seq_len: int = Field(4096, gt=0, description="Longest supported sequence.")
    rope_theta: float = Field(10000.0, gt=0, description="RoPE base frequency.")
    rope_scaling: RopeScaling | None = Field(None, description="RoPE scaled beyond the "
                                             "pretraining window; None: plain RoPE.")
    norm_eps: float = Field(1e-5, gt=0, description="RMSNorm epsilon.")

    @model_validator(mode="after")
    def _check(self) -> "ModelSpec":
        from planner.specs.families import FAMILIES

        if self.family not in FAMILIES:
            raise PlanError(f"model family {self.family!r} is not supported (allowed: "
                            f"{', '.join(FAMILIES)})", field="model")
        if self.head_dim is None and self.hidden % self.n_heads:
            raise PlanError(
                f"hidden ({self.hidden}) must be divisible by n_heads ({self.n_heads}) "
                "or head_dim must be given", field="model")
        if self.n_heads % self.n_kv_heads:
            raise PlanError(
                f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads "
                f"({self.n_kv_heads})", field="model")
        return self

    # ---- derived sizes -------------------------------------------------------
    @property
    def kv_channels(self) -> int:
        """Per-head size."""
        return self.head_dim if self.head_dim is not None else self.hidden // self.n_heads

    @property
    def padded_vocab(self) -> int:
        """Vocabulary padded to :data:`VOCAB_PAD_MULTIPLE` (identical for every TP)."""
        m = VOCAB_PAD_MULTIPLE
        return -(-self.vocab_size // m) * m

    @property
    def qkv_out(self) -> int:
        """Rows of the fused QKV projection: (heads + 2 kv heads) x head size."""
        return (self.n_heads + 2 * self.n_kv_heads) * self.kv_channels

    def layer_sharded_params(self) -> int:
        """Parameters of one layer that TP splits (QKV, proj, fc1, fc2, QKV bias)."""
        h, d = self.hidden, self.kv_channels
        qkv = self.qkv_out * h + (self.qkv_out if self.qkv_bias else 0)
        proj = h * self.n_heads * d
        mlp = 2 * self.ffn_hidden * h + self.ffn_hidden * h
        return qkv + proj + mlp

    def layer_replicated_params(self) -> int:
        """Parameters of one layer that every TP rank holds whole (two RMSNorms, and the
        per-head query and key norms where the family has them)."""
        return 2 * self.hidden + (2 * self.kv_channels if self.qk_norm else 0)

    def layer_params(self) -> int:
        return self.layer_sharded_params() + self.layer_replicated_params()

    def embedding_params(self) -> int:
        """Word embedding (vocab-parallel: TP splits the padded vocabulary)."""
        return self.padded_vocab * self.hidden

    def head_params(self, head: str) -> int:
        """Output head: ``lm`` (vocab x hidden, vocab-parallel) or ``value`` (hidden -> 1)."""
        return self.padded_vocab * self.hidden if head == "lm" else self.hidden

    def total_params(self, head: str = "lm") -> int:
        """All parameters of one full copy; a tied LM head is counted once."""
        n = self.n_layers * self.layer_params() + self.embedding_params() + self.hidden
        if head == "value" or not self.tied_embeddings:
            n += self.head_params(head)
        return n

    def matmul_params_per_token(self, head: str) -> int:
        """Weights a token multiplies through in a forward pass (no embedding lookup)."""
        return self.n_layers * self.layer_sharded_params() + self.head_params(head)


_PRESET_DIR = Path(__file__).parents[1] / "presets"


def model_presets() -> dict[str, ModelSpec]:
    """All model presets by name (read from the packaged JSON table)."""
    raw = json.loads((_PRESET_DIR / "models.json").read_text())
    return {name: ModelSpec(name=name, **fields) for name, fields in raw.items()}


#: ModelSpec field -> the config.json key it is read from (for error messages)
_HF_KEYS = {"n_layers": "num_hidden_layers", "hidden": "hidden_size",
            "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads",
            "ffn_hidden": "intermediate_size", "vocab_size": "vocab_size",
            "head_dim": "head_dim", "max_seq_len": "max_position_embeddings",
            "rope_theta": "rope_theta", "norm_eps": "rms_norm_eps"}


def model_spec_from_hf_config(path: str | Path, name: str | None = None) -> ModelSpec:
    """Read a Hugging Face ``config.json`` (a file or a folder that holds one); a
    :class:`PlanError` naming the file and the key for anything it cannot use."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise PlanError(f"no config.json at {str(path)!r}", field="model")
    try:
        cfg = json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PlanError(f"{p} is not valid JSON ({e})", field="model") from None
    if not isinstance(cfg, dict):
        raise PlanError(f"{p} holds a {type(cfg).__name__}, not the JSON object of a "
                        "model config", field="model")
    required = ["num_hidden_layers", "hidden_size", "num_attention_heads",
                "intermediate_size", "vocab_size"]
    missing = [k for k in required if k not in cfg]
    if missing:
        raise PlanError(f"{p} lacks the key {missing[0]!r} that a decoder's config.json "
                        "has", field="model")
    from planner.specs.families import FAMILIES
    from planner.specs.families.base import spec_fields

    kind = cfg.get("model_type")
    if not isinstance(kind, str) or kind not in FAMILIES:
        raise PlanError(f"{p}: model_type {kind!r} is not supported (allowed: "
                        f"{', '.join(FAMILIES)})", field="model")
    try:
        fields = dict(name=name or p.parent.name or "hf-model",
                      **spec_fields(cfg, FAMILIES[kind]))
    except PlanError as e:
        raise PlanError(f"{p}: {e.message}", field="model") from None
    for key in ("n_layers", "hidden", "n_heads", "n_kv_heads", "ffn_hidden", "vocab_size",
                "head_dim", "max_seq_len"):
        value = fields[key]        # whole numbers only: no 4.5 layers, no "four" heads
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise PlanError(f"{p}: {_HF_KEYS[key]} must be a whole number, got {value!r}",
                            field="model")
    try:
        return ModelSpec(**fields)
    except ValidationError as e:
        raise from_validation(e, ModelSpec, context=f"{p}: ", field="model", cls=PlanError,
                              renames=_HF_KEYS) from None
    except PlanError as e:
        raise PlanError(f"{p}: {e.message}", field="model") from None


def resolve_model(ref: str) -> ModelSpec:
    """A preset name, or a path to a HF ``config.json`` / checkpoint folder."""
    presets = model_presets()
    if ref in presets:
        return presets[ref]
    p = Path(ref)
    if p.exists():
        return model_spec_from_hf_config(p)
    raise PlanError(
        f"{ref!r} is neither a preset ({', '.join(sorted(presets))}) nor a path to a "
        "Hugging Face config.json", field="model")
