"""Qwen3-MoE (``model_type: qwen3_moe``: Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's
attention (per-head query/key RMSNorm, explicit ``head_dim``, no QKV bias) with a
mixture of experts in place of the dense MLP.

On a sparse layer the router ``mlp.gate`` ([experts, hidden], no bias) scores each
token, a softmax over all experts gives its probabilities, the ``num_experts_per_tok``
best experts run (each a SwiGLU of ``moe_intermediate_size``) and their outputs are
summed, weighted by their probabilities, renormalised to sum to 1 when
``norm_topk_prob``. Layer ``i`` is sparse unless it is in ``mlp_only_layers`` or
``(i + 1) % decoder_sparse_step != 0``; the others keep the dense MLP of
``intermediate_size``. No shared experts (Qwen3-MoE has none; Qwen2-MoE's shared expert
is another ``model_type``). ``router_aux_loss_coef`` weighs the load-balancing loss in
training.

Weights: per expert ``model.layers.<i>.mlp.experts.<e>.{gate,up,down}_proj.weight`` (what
transformers 5's ``save_pretrained`` writes, though it holds them fused in memory) and the
router ``model.layers.<i>.mlp.gate.weight``. transformers writes ``num_experts`` as
``num_local_experts``: both are read.
"""
from __future__ import annotations

from typing import Any, Mapping

from planner.errors import PlanError
from planner.specs.families.base import DecoderFamily


def moe_fields(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """ModelSpec's ``moe`` of a Qwen3-MoE config (see the module docstring)."""
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    top_k = cfg.get("num_experts_per_tok")
    size = cfg.get("moe_intermediate_size")
    for key, value in (("num_experts", experts), ("num_experts_per_tok", top_k),
                       ("moe_intermediate_size", size)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise PlanError(f"{key} must be a positive whole number in a qwen3_moe config, "
                            f"got {value!r}", field="model")
    if cfg.get("shared_expert_intermediate_size") or cfg.get("n_shared_experts"):
        raise PlanError("shared experts are not part of qwen3_moe (realign runs routed "
                        "experts only)", field="model")
    n = cfg["num_hidden_layers"]
    step = cfg.get("decoder_sparse_step", 1)
    only = cfg.get("mlp_only_layers") or []
    if isinstance(step, bool) or not isinstance(step, int) or step <= 0:
        raise PlanError(f"decoder_sparse_step must be a positive whole number, got {step!r}",
                        field="model")
    if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool)
                                             for i in only):
        raise PlanError(f"mlp_only_layers must be a list of layer numbers, got {only!r}",
                        field="model")
    bad = [i for i in only if not 0 <= i < n]
    if bad:
        raise PlanError(f"mlp_only_layers names layer {bad[0]}, outside 0..{n - 1}",
                        field="model")
    dense = tuple(i for i in range(n) if i in only or (i + 1) % step != 0)
    coef = cfg.get("router_aux_loss_coef", 0.0)
    return dict(n_experts=experts, top_k=top_k, expert_ffn_hidden=size,
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), dense_layers=dense,
                router_aux_loss_coef=float(coef) if coef is not None else 0.0)


FAMILY = DecoderFamily(
    model_type="qwen3_moe", causal_lm="Qwen3MoeForCausalLM",
    classifier="Qwen3MoeForSequenceClassification", qk_norm=True,
    extra_layer_names={"q_norm": ("self_attn.q_norm.weight",),
                       "k_norm": ("self_attn.k_norm.weight",),
                       "router": ("mlp.gate.weight",),
                       "expert_fc1": ("mlp.experts.{expert}.gate_proj.weight",
                                      "mlp.experts.{expert}.up_proj.weight"),
                       "expert_fc2": ("mlp.experts.{expert}.down_proj.weight",)},
    moe_fields=moe_fields)
