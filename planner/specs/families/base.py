"""What the dense decoder families share: the LLaMA decoder (pre-norm RMSNorm,
grouped-query attention with RoPE, gated SiLU MLP) read from a ``config.json``, the
HF names of its tensors, and the refusals that apply to every family.

A family (one module beside this one) is a :class:`DecoderFamily`: its ``model_type``,
its classes for an exported ``config.json``, its forward options and the HF names of
the tensors it adds. :func:`spec_fields` maps a config onto ModelSpec's fields.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from planner.errors import PlanError

#: logical tensor kind (``LogicalTensor.content``'s last part) -> its HF names in a
#: layer, in the order realign concatenates them (q, k, v into the fused QKV; gate,
#: up into fc1)
LLAMA_LAYER_NAMES: Mapping[str, tuple[str, ...]] = {
    "ln1": ("input_layernorm.weight",),
    "ln2": ("post_attention_layernorm.weight",),
    "qkv": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "qkv_bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    "proj": ("self_attn.o_proj.weight",),
    "fc1": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "fc2": ("mlp.down_proj.weight",),
}
#: the tensors outside the layers
MODEL_NAMES: Mapping[str, tuple[str, ...]] = {
    "embedding": ("model.embed_tokens.weight",),
    "final_norm": ("model.norm.weight",),
    "output": ("lm_head.weight",),
    "value_head": ("score.weight",),
}
#: rope scalings realign computes (their frequencies come from transformers' own
#: functions, so they are the checkpoint's)
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class DecoderFamily:
    """One dense decoder family."""

    model_type: str                       #: config.json's ``model_type``
    causal_lm: str                        #: transformers class of an LM checkpoint
    classifier: str                       #: ... of a sequence-classification (reward) one
    qkv_bias: bool = False                #: q/k/v projections have a bias by default
    qk_norm: bool = False                 #: per-head RMSNorm on queries and keys (Qwen3)
    window_by_default: bool = False       #: ``sliding_window`` applies unless switched off
    #: HF names of the layer tensors this family adds (kind -> names); an expert's
    #: names hold ``{expert}``, its number
    extra_layer_names: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    #: a mixture of experts' fields of ModelSpec (``moe``) from a config; None: a dense
    #: family, whose configs with experts are refused
    moe_fields: Callable[[Mapping[str, Any]], dict[str, Any]] | None = None

    def layer_names(self, kind: str, expert: int | None = None) -> tuple[str, ...]:
        """HF names (within ``model.layers.<i>.``) of a layer tensor of this kind
        (``expert``: the expert's number, for an expert's tensors)."""
        if kind in self.extra_layer_names:
            names = self.extra_layer_names[kind]
            return names if expert is None else tuple(n.format(expert=expert) for n in names)
        return LLAMA_LAYER_NAMES[kind]


def refusals(cfg: Mapping[str, Any], family: DecoderFamily) -> str | None:
    """Why realign cannot run this config (None when it can): a mixture of experts in a
    dense family, a rope scaling it does not compute, sliding windows on some layers
    only, an MLP bias."""
    experts = max(_int(cfg.get(k)) for k in ("num_experts", "num_local_experts", "n_routed_experts"))
    if experts > 0 and family.moe_fields is None:
        return (f"a mixture of experts ({experts} experts) is not supported in model_type "
                f"{family.model_type!r}: realign runs experts of model_type qwen3_moe only")
    rope = rope_parameters(cfg)
    kind = rope.get("rope_type") or "default"
    if kind not in ROPE_TYPES:
        return f"rope_type {kind!r} is not supported (allowed: {', '.join(ROPE_TYPES)})"
    if cfg.get("mlp_bias"):
        return "mlp_bias=true is not supported (these families' MLPs have no bias)"
    if windowed(cfg, family):
        types = cfg.get("layer_types")
        if isinstance(types, list) and len(set(types)) > 1:
            return ("sliding windows on some layers only (layer_types mixes "
                    f"{', '.join(sorted(set(map(str, types))))}) are not supported: realign "
                    "attends with one window, or none, on every layer")
        n = _int(cfg.get("num_hidden_layers"))
        top = cfg.get("max_window_layers")
        if family.model_type != "mistral" and isinstance(top, int) and 0 < top < n:
            return (f"a sliding window on the first {top} of {n} layers only "
                    "(max_window_layers) is not supported: realign attends with one window, "
                    "or none, on every layer")
    return None


def windowed(cfg: Mapping[str, Any], family: DecoderFamily) -> bool:
    """The config attends within a sliding window (on some or all layers)."""
    window = cfg.get("sliding_window")
    return bool(window) and bool(cfg.get("use_sliding_window", family.window_by_default))


def rope_parameters(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The rope settings of a config: transformers 5's ``rope_parameters``, with the older
    ``rope_scaling`` over it (transformers reads a scaling there first, and a config
    saved by transformers 5 holds a default ``rope_parameters`` beside it)."""
    out: dict[str, Any] = {}
    for key in ("rope_parameters", "rope_scaling"):
        value = cfg.get(key)
        if isinstance(value, dict):
            out.update(value)
            if "type" in value and "rope_type" not in value:     # the oldest spelling
                out["rope_type"] = value["type"]
    return out


def rope_scaling_fields(cfg: Mapping[str, Any]) -> dict[str, Any] | None:
    """ModelSpec's ``rope_scaling`` from a config: None for plain RoPE, else its type and
    the numbers that type reads (``factor`` and the type's own)."""
    rope = rope_parameters(cfg)
    kind = rope.get("rope_type") or "default"
    if kind == "default":
        return None
    keep = ("factor", "original_max_position_embeddings", "low_freq_factor",
            "high_freq_factor", "beta_fast", "beta_slow", "attention_factor", "mscale",
            "mscale_all_dim", "truncate")
    out = {k: rope[k] for k in keep if rope.get(k) is not None}
    if "original_max_position_embeddings" not in out and cfg.get(
            "original_max_position_embeddings") is not None:
        out["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
    return {"rope_type": kind, **out}


def spec_fields(cfg: Mapping[str, Any], family: DecoderFamily) -> dict[str, Any]:
    """ModelSpec's fields (all but ``name``) of a config of ``family``; a
    :class:`PlanError` naming what realign does not run."""
    problem = refusals(cfg, family)
    if problem:
        raise PlanError(problem, field="model")
    rope = rope_parameters(cfg)
    n_heads = cfg["num_attention_heads"]
    max_len = cfg.get("max_position_embeddings", 4096)
    if windowed(cfg, family) and isinstance(cfg["sliding_window"], int):
        # within the window, windowed attention is the full causal attention realign
        # computes: cap the sequence there
        max_len = min(max_len, cfg["sliding_window"])
    return dict(
        family=family.model_type,
        n_layers=cfg["num_hidden_layers"],
        hidden=cfg["hidden_size"],
        n_heads=n_heads,
        n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
        ffn_hidden=cfg["intermediate_size"],
        vocab_size=cfg["vocab_size"],
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bool(cfg.get("attention_bias", family.qkv_bias)),
        qk_norm=family.qk_norm,
        head_dim=cfg.get("head_dim"),
        max_seq_len=max_len,
        rope_theta=rope.get("rope_theta", cfg.get("rope_theta", 10000.0)),
        rope_scaling=rope_scaling_fields(cfg),
        norm_eps=cfg.get("rms_norm_eps", 1e-5),
        moe=family.moe_fields(cfg) if family.moe_fields is not None else None,
    )


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0
