"""LoRA adapters: their settings, and the logical tensors they add to a model.

An adapter on a linear layer ``y = x W^T`` adds ``(alpha / rank) * (x A^T) B^T``, with
``A`` [rank, in] and ``B`` [out, rank]; the base ``W`` is frozen. The targets are
megatron's four linear layers of every decoder layer:

========== =========================== =============== ===========================
target     Hugging Face (PEFT) names   base sharding   adapter sharding under TP
========== =========================== =============== ===========================
linear_qkv q_proj, k_proj, v_proj      column (out)    A whole, B split by output
linear_proj o_proj                     row (in)        A split by input, B whole
linear_fc1 gate_proj, up_proj          column, 2 parts A whole, B split part by part
linear_fc2 down_proj                   row (in)        A split by input, B whole
========== =========================== =============== ===========================

megatron fuses q/k/v (and gate/up) into one layer, so one ``A`` serves the fused
layer: the PEFT equivalent is q_proj, k_proj and v_proj with equal ``A`` and ``B``
split by rows (:mod:`realign.runtime.lora_peft` writes and reads it so).

The adapters are described with the same :class:`LogicalTensor` as the base weights,
so the planner prices and the runtime moves the very same slices
(:func:`adapter_stage_tensors`).
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from planner.specs.model_spec import ModelSpec
from planner.specs.param_layout import LogicalTensor

Target = Literal["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
TARGETS: tuple[str, ...] = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")

#: Hugging Face (PEFT) module names -> megatron's fused target; a fused target needs
#: every one of its names
HF_TARGETS: dict[str, str] = {
    "q_proj": "linear_qkv", "k_proj": "linear_qkv", "v_proj": "linear_qkv",
    "o_proj": "linear_proj", "gate_proj": "linear_fc1", "up_proj": "linear_fc1",
    "down_proj": "linear_fc2",
}
#: each target's Hugging Face names, in megatron's concatenation order
HF_NAMES: dict[str, tuple[str, ...]] = {
    "linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",),
}
#: column-parallel targets (output split over TP); the others are row-parallel
COLUMN = ("linear_qkv", "linear_fc1")
#: the submodule of a decoder layer that holds each target
MODULE_OF = {"linear_qkv": "self_attention", "linear_proj": "self_attention",
             "linear_fc1": "mlp", "linear_fc2": "mlp"}


def resolve_targets(names: list[str]) -> tuple[str, ...]:
    """Target names as a user writes them -> megatron's targets, in :data:`TARGETS`
    order. Accepts megatron's names, PEFT's (a fused layer needs all its parts) and
    ``all-linear``. Raises ValueError (pydantic names the field) on a name that matches
    no layer, or on part of a fused layer.

    ``["q_proj", "k_proj", "v_proj", "down_proj"]`` -> ``("linear_qkv", "linear_fc2")``.
    """
    if not names:
        raise ValueError("no target modules: name at least one of " + ", ".join(TARGETS)
                         + " (or their PEFT names, or all-linear)")
    out: set[str] = set()
    hf_seen: set[str] = set()
    for n in names:
        if n == "all-linear":
            out.update(TARGETS)
        elif n in TARGETS:
            out.add(n)
        elif n in HF_TARGETS:
            hf_seen.add(n)
            out.add(HF_TARGETS[n])
        else:
            raise ValueError(f"target module {n!r} matches no layer of a LLaMA-family "
                             f"decoder; allowed: {', '.join(TARGETS)}, "
                             f"{', '.join(HF_TARGETS)} or all-linear")
    for target, parts in HF_NAMES.items():
        named = [p for p in parts if p in hf_seen]
        if named and len(named) != len(parts) and target not in names:
            missing = ", ".join(p for p in parts if p not in named)
            raise ValueError(f"{', '.join(named)} without {missing}: realign fuses "
                             f"{', '.join(parts)} into one layer ({target}) with one "
                             "adapter; name all of them (or the fused name)")
    return tuple(t for t in TARGETS if t in out)


class LoraSpec(BaseModel):
    """LoRA on a model role: the base weights are frozen; only the adapters (and a value
    head, which is new) are trained."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rank: int = Field(gt=0, le=65536, description="The adapters' rank r (> 0).")
    alpha: float | None = Field(None, gt=0, description="Scale numerator: the update is "
                                "(alpha / rank) * B A x. Unset: alpha = rank (scale 1).")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapters' "
                           "input while training (0: none).")
    target_modules: tuple[str, ...] = Field(
        TARGETS, description="Layers that get an adapter: linear_qkv, linear_proj, "
        "linear_fc1, linear_fc2 (megatron's names), their PEFT names (q_proj+k_proj+v_proj, "
        "o_proj, gate_proj+up_proj, down_proj) or all-linear. Default: all four.")

    @field_validator("target_modules", mode="before")
    @classmethod
    def _targets(cls, v: object) -> tuple[str, ...]:
        if isinstance(v, str):
            v = [v]
        if not isinstance(v, (list, tuple)):
            raise ValueError("give a list of module names")
        return resolve_targets([str(x) for x in v])

    @property
    def scale(self) -> float:
        return (self.alpha if self.alpha is not None else self.rank) / self.rank

    def layer_tensors(self, spec: ModelSpec, layer: int) -> list[LogicalTensor]:
        """The adapter tensors of decoder layer ``layer`` (global number), named after
        the base weight's module: ``decoder.layers.3.mlp.linear_fc1.lora_A``."""
        out = []
        for target in self.target_modules:
            k, n = target_dims(spec, target)
            pre = f"decoder.layers.{layer}.{MODULE_OF[target]}.{target}."
            content = f"decoder.layers.{layer}.lora.{target}."
            r = self.rank
            if target in COLUMN:
                parts = 2 if target == "linear_fc1" else 1
                out += [LogicalTensor(pre + "lora_A", (r, k), None, 1, content + "A", layer),
                        LogicalTensor(pre + "lora_B", (n, r), 0, parts, content + "B", layer)]
            else:
                out += [LogicalTensor(pre + "lora_A", (r, k), 1, 1, content + "A", layer),
                        LogicalTensor(pre + "lora_B", (n, r), None, 1, content + "B", layer)]
        return out

    def layer_params(self, spec: ModelSpec) -> tuple[int, int]:
        """(TP-sharded, replicated) adapter parameters of one layer, full sizes."""
        sharded = replicated = 0
        for t in self.layer_tensors(spec, 0):
            if t.shard_dim is None:
                replicated += t.numel
            else:
                sharded += t.numel
        return sharded, replicated

    def total_params(self, spec: ModelSpec) -> int:
        s, r = self.layer_params(spec)
        return spec.n_layers * (s + r)

    def gemms(self, spec: ModelSpec, tp: int) -> list[tuple[float, float]]:
        """(K, N) of one layer's adapter GEMMs on one TP rank: ``x A^T`` then ``z B^T``
        per target (the row-parallel ones read the rank's input slice)."""
        out: list[tuple[float, float]] = []
        for target in self.target_modules:
            k, n = target_dims(spec, target)
            if target in COLUMN:
                out += [(k, self.rank), (self.rank, n / tp)]
            else:
                out += [(k / tp, self.rank), (self.rank, n)]
        return out


def target_dims(spec: ModelSpec, target: str) -> tuple[int, int]:
    """(in, out) features of a target's full base weight."""
    h, f = spec.hidden, spec.ffn_hidden
    return {"linear_qkv": (h, spec.qkv_out),
            "linear_proj": (spec.n_heads * spec.kv_channels, h),
            "linear_fc1": (h, 2 * f), "linear_fc2": (f, h)}[target]


def adapter_stage_tensors(spec: ModelSpec, lora: LoraSpec, pp: int, stage: int
                          ) -> list[LogicalTensor]:
    """The adapter tensors held by pipeline stage ``stage`` of ``pp`` (every TP rank)."""
    per = spec.n_layers // pp
    out: list[LogicalTensor] = []
    for layer in range(stage * per, (stage + 1) * per):
        out += lora.layer_tensors(spec, layer)
    return out


def trained_stage_tensors(spec: ModelSpec, head: str, lora: LoraSpec, pp: int, stage: int
                          ) -> list[LogicalTensor]:
    """What a LoRA model trains on a stage (the tensors that change, so the only ones a
    reallocation must move once the frozen base is in place): its adapters, and on the
    last stage a value head (a new head has no pretrained values to keep frozen)."""
    from planner.specs.param_layout import stage_tensors

    out = adapter_stage_tensors(spec, lora, pp, stage)
    if head == "value" and stage == pp - 1:
        out += [t for t in stage_tensors(spec, head, pp, stage) if t.content == "value_head"]
    return out


def moved_stage_tensors(spec: ModelSpec, head: str, lora: LoraSpec | None, pp: int,
                        stage: int) -> list[LogicalTensor]:
    """The tensors a reallocation of a stage moves: every parameter
    (:func:`planner.specs.param_layout.stage_tensors`), or with LoRA only what training
    changes (:func:`trained_stage_tensors`): the frozen base already sits at the
    destination."""
    from planner.specs.param_layout import stage_tensors

    if lora is None:
        return stage_tensors(spec, head, pp, stage)
    return trained_stage_tensors(spec, head, lora, pp, stage)
