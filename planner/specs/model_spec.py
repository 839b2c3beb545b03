"""ModelSpec: architecture numbers of a LLaMA-family decoder, and its parameter counts.

Only numbers live here (no weights): layers, hidden size, heads, KV heads (grouped
query attention), FFN size (SwiGLU), vocabulary, tied embeddings, QKV bias, and for a
mixture of experts (:class:`MoeSpec`, Qwen3-MoE) the experts, how many each token uses
and which layers keep the dense MLP. Presets come from ``planner/presets/models.json``;
a Hugging Face ``config.json`` is read by :func:`model_spec_from_hf_config`.

A mixture of experts has two sizes: all its parameters (:meth:`ModelSpec.total_params`:
memory holds every expert) and those one token multiplies through
(:meth:`ModelSpec.active_params`: compute runs the router's top-k experts only).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from planner.errors import PlanError, from_validation
from planner.specs.families import FAMILIES
from planner.specs.families.base import spec_fields

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


class MoeSpec(BaseModel):
    """The mixture of experts of a sparse decoder (Qwen3-MoE): on each sparse layer a
    router (``[n_experts, hidden]``, softmax over the experts, the ``top_k`` best) and
    ``n_experts`` SwiGLU experts of ``expert_ffn_hidden``, in place of the dense MLP.
    No shared experts (Qwen3-MoE has none)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    n_experts: int = Field(gt=0, description="Routed experts per sparse layer "
                           "(config.json's num_experts).")
    top_k: int = Field(gt=0, description="Experts each token is sent to "
                       "(num_experts_per_tok).")
    expert_ffn_hidden: int = Field(gt=0, description="SwiGLU intermediate size of one "
                                   "expert (moe_intermediate_size).")
    norm_topk_prob: bool = Field(False, description="The top-k routing weights are "
                                 "renormalised to sum to 1 (else: their softmax "
                                 "probabilities over all experts).")
    dense_layers: tuple[int, ...] = Field((), description="Layers (0-based) that keep the "
                                          "dense MLP of ffn_hidden: config.json's "
                                          "mlp_only_layers and the layers off its "
                                          "decoder_sparse_step.")
    router_aux_loss_coef: float = Field(0.0, ge=0, description="Weight of the router's "
                                        "load-balancing loss in training "
                                        "(router_aux_loss_coef).")

    @model_validator(mode="after")
    def _check(self) -> "MoeSpec":
        if self.top_k > self.n_experts:
            raise PlanError(f"num_experts_per_tok ({self.top_k}) must be at most num_experts "
                            f"({self.n_experts}): a token is sent to top-k of the experts",
                            field="model.moe.top_k")
        if list(self.dense_layers) != sorted(set(self.dense_layers)):
            raise PlanError(f"dense_layers {list(self.dense_layers)} must be increasing "
                            "without repeats", field="model.moe.dense_layers")
        return self

    def expert_params(self, hidden: int) -> int:
        """Parameters of one expert (gate, up and down projections)."""
        return 3 * self.expert_ffn_hidden * hidden


class ModelSpec(BaseModel):
    """Architecture of a decoder-only transformer of a supported family
    (:mod:`planner.specs.families`: LLaMA, Mistral, Qwen2, Qwen3, and Qwen3-MoE's
    mixture of experts)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="Preset or user name, used in plans and reports.")
    family: str = Field("llama", description="config.json's model_type: llama | mistral | "
                        "qwen2 | qwen3 | qwen3_moe (its weight names and forward options).")
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
    moe: MoeSpec | None = Field(None, description="The mixture of experts (Qwen3-MoE); "
                                "None: every layer has the dense MLP.")

    @model_validator(mode="after")
    def _check(self) -> "ModelSpec":
        if self.family not in FAMILIES:
            raise PlanError(f"model family {self.family!r} is not supported (allowed: "
                            f"{', '.join(FAMILIES)})", field="model")
        if (self.moe is not None) != (FAMILIES[self.family].moe_fields is not None):
            raise PlanError(f"model family {self.family!r} "
                            + ("has no experts: leave moe out" if self.moe is not None
                               else "is a mixture of experts: give moe"), field="model.moe")
        if self.head_dim is None and self.hidden % self.n_heads:
            raise PlanError(
                f"hidden ({self.hidden}) must be divisible by n_heads ({self.n_heads}) "
                "or head_dim must be given", field="model")
        if self.n_heads % self.n_kv_heads:
            raise PlanError(
                f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads "
                f"({self.n_kv_heads})", field="model")
        if self.moe is not None and self.moe.dense_layers and (
                self.moe.dense_layers[-1] >= self.n_layers or self.moe.dense_layers[0] < 0):
            raise PlanError(f"moe.dense_layers {list(self.moe.dense_layers)} must lie in "
                            f"0..{self.n_layers - 1}", field="model.moe.dense_layers")
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

    def is_sparse(self, layer: int) -> bool:
        """Layer ``layer`` (0-based) routes its tokens to experts (else: the dense MLP)."""
        return self.moe is not None and layer not in self.moe.dense_layers

    def sparse_layers(self) -> int:
        """How many layers carry experts."""
        return 0 if self.moe is None else self.n_layers - len(self.moe.dense_layers)

    def _attention_sharded_params(self) -> int:
        h, d = self.hidden, self.kv_channels
        qkv = self.qkv_out * h + (self.qkv_out if self.qkv_bias else 0)
        return qkv + h * self.n_heads * d

    def _mlp_sharded_params(self, sparse: bool) -> int:
        """The MLP's TP-split weights: the dense SwiGLU, or every expert of a sparse
        layer (TP splits each expert as it splits the dense MLP)."""
        if sparse:
            assert self.moe is not None
            return self.moe.n_experts * self.moe.expert_params(self.hidden)
        return 3 * self.ffn_hidden * self.hidden

    def _heaviest_is_sparse(self) -> bool:
        """The layer the per-layer sizes describe: a sparse one when the model has any
        and it outweighs the dense MLP."""
        if self.sparse_layers() == 0:
            return False
        if self.sparse_layers() == self.n_layers:
            return True
        router = self.hidden * self.moe.n_experts if self.moe is not None else 0
        return self._mlp_sharded_params(True) + router >= self._mlp_sharded_params(False)

    def layer_sharded_params(self, layer: int | None = None) -> int:
        """Parameters of a layer that TP splits (QKV, proj, the MLP or every expert's
        fc1 and fc2, QKV bias). ``layer`` None: the heaviest layer (every layer of a
        dense model; a bound for a mixture of experts whose dense layers are lighter)."""
        sparse = self._heaviest_is_sparse() if layer is None else self.is_sparse(layer)
        return self._attention_sharded_params() + self._mlp_sharded_params(sparse)

    def layer_expert_params(self, layer: int | None = None) -> int:
        """The experts' parameters among :meth:`layer_sharded_params` (what expert
        parallelism divides): every expert of a sparse layer, 0 for a dense one;
        ``layer`` None: the heaviest layer's."""
        sparse = self._heaviest_is_sparse() if layer is None else self.is_sparse(layer)
        return self._mlp_sharded_params(True) if sparse else 0

    def layer_replicated_params(self, layer: int | None = None) -> int:
        """Parameters of a layer that every TP rank holds whole (two RMSNorms, the
        per-head query and key norms where the family has them, a sparse layer's
        router); ``layer`` None: the heaviest layer's."""
        sparse = self._heaviest_is_sparse() if layer is None else self.is_sparse(layer)
        router = self.moe.n_experts * self.hidden if sparse and self.moe is not None else 0
        return 2 * self.hidden + (2 * self.kv_channels if self.qk_norm else 0) + router

    def layer_params(self, layer: int | None = None) -> int:
        return self.layer_sharded_params(layer) + self.layer_replicated_params(layer)

    def embedding_params(self) -> int:
        """Word embedding (vocab-parallel: TP splits the padded vocabulary)."""
        return self.padded_vocab * self.hidden

    def head_params(self, head: str) -> int:
        """Output head: ``lm`` (vocab x hidden, vocab-parallel) or ``value`` (hidden -> 1)."""
        return self.padded_vocab * self.hidden if head == "lm" else self.hidden

    def _outside_params(self, head: str) -> int:
        n = self.embedding_params() + self.hidden
        if head == "value" or not self.tied_embeddings:
            n += self.head_params(head)
        return n

    def total_params(self, head: str = "lm") -> int:
        """All parameters of one full copy (every expert); a tied LM head is counted
        once. The vocabulary is the padded one (:attr:`padded_vocab`)."""
        if self.moe is None:
            return self.n_layers * self.layer_params() + self._outside_params(head)
        return (sum(self.layer_params(i) for i in range(self.n_layers))
                + self._outside_params(head))

    def active_params(self, head: str = "lm") -> int:
        """Parameters one token uses: :meth:`total_params` less, on every sparse layer,
        the experts the router does not pick (all but ``top_k``). Equal to the total
        for a dense model."""
        if self.moe is None:
            return self.total_params(head)
        idle = self.moe.n_experts - self.moe.top_k
        return self.total_params(head) - self.sparse_layers() * idle * self.moe.expert_params(
            self.hidden)

    def matmul_params_per_token(self, head: str) -> int:
        """Weights a token multiplies through in a forward pass (no embedding lookup):
        a sparse layer's router and its top-k experts."""
        n = self.head_params(head)
        for i in range(self.n_layers):
            n += self._attention_sharded_params()
            if self.is_sparse(i):
                assert self.moe is not None
                n += self.moe.n_experts * self.hidden + self.moe.top_k * self.moe.expert_params(
                    self.hidden)
            else:
                n += self._mlp_sharded_params(False)
        return n

    def mlp_activation_width(self) -> int:
        """Columns of a token's stored MLP activations in the heaviest layer (fc1's
        output and the gated product): ``3 x ffn`` for the dense MLP, ``3 x top_k x
        expert ffn`` plus the router's logits for a sparse layer."""
        dense = 3 * self.ffn_hidden if self.sparse_layers() < self.n_layers else 0
        if self.moe is None:
            return dense
        return max(dense, 3 * self.moe.top_k * self.moe.expert_ffn_hidden + self.moe.n_experts)


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
