"""Parameter counts of a LoRA model on one GPU, as the cost model prices them: the
adapters of a stage's layers (split over TP as :mod:`planner.specs.lora` says) and what
training keeps gradients and optimizer state for."""
from __future__ import annotations

from planner.specs.layout import Layout
from planner.specs.lora import LoraSpec
from planner.specs.model_spec import ModelSpec


def adapter_params(spec: ModelSpec, head: str, layout: Layout, lora: LoraSpec | None) -> float:
    """Adapter parameters on one GPU of a stage (0 without LoRA): a column-parallel
    target's B and a row-parallel one's A split over TP, the other factor whole.

    Example: LLaMA-2 70B, rank 64 on all four targets, tp 8, pp 4: 20 layers x
    (6,684,672 / 8 + 2,097,152) = 58.7M parameters (the stage's weights: 2.17e9)."""
    if lora is None:
        return 0.0
    sharded, replicated = lora.layer_params(spec)
    return spec.n_layers // layout.pp * (sharded / layout.tp + replicated)


def trained_params(spec: ModelSpec, head: str, layout: Layout, lora: LoraSpec) -> float:
    """What a LoRA model trains on one GPU of its last stage: its adapters, and a value
    head (new, so trained)."""
    return adapter_params(spec, head, layout, lora) + (spec.hidden if head == "value" else 0.0)
