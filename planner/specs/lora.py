"""LoRA adapters: their settings, and the logical tensors they add to a model.

An adapter on a linear layer ``y = x W^T`` adds ``(alpha / rank) * (x A^T) B^T``, with
``A`` [rank, in] and ``B`` [out, rank]; the base ``W`` is frozen. PEFT adapts each
Hugging Face projection on its own; megatron fuses q/k/v into ``linear_qkv`` and
gate/up into ``linear_fc1``. realign keeps PEFT's function and parameter count on the
fused layers: a fused layer with adapted parts ``S`` holds one ``A`` of ``|S| * rank``
rows (the parts' ``A`` stacked in megatron's order) and one ``B`` of the adapted parts'
output rows only, in megatron's row order; part ``p``'s rows of ``B`` read only part
``p``'s block of ``x A^T`` (a block-structured ``B``, stored dense by rows). So any
subset of the parts may be adapted (``q_proj`` and ``v_proj`` alone) and the trainable
parameters are PEFT's: ``|S| * rank * in + rank * out(S)``.

========== =========================== =============== ==============================
target     Hugging Face (PEFT) names   base sharding   adapter sharding under TP
========== =========================== =============== ==============================
linear_qkv q_proj, k_proj, v_proj      column (out)    A whole, B split by query group
linear_proj o_proj                     row (in)        A split by input, B whole
linear_fc1 gate_proj, up_proj          column, 2 parts A whole, B split part by part
linear_fc2 down_proj                   row (in)        A split by input, B whole
========== =========================== =============== ==============================

``shared_a`` (off by default) is the cheaper variant: one ``A`` of ``rank`` rows shared
by a fused layer's adapted parts (fewer parameters than PEFT; a PEFT adapter loads only
if its fused parts have equal ``A``).

The adapters are described with the same :class:`LogicalTensor` as the base weights,
so the planner prices and the runtime moves the very same slices
(:func:`adapter_stage_tensors`).
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from planner.specs.model_spec import ModelSpec
from planner.specs.param_layout import LogicalTensor, stage_tensors

Target = Literal["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
TARGETS: tuple[str, ...] = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")

#: Hugging Face (PEFT) module names -> megatron's target that holds them
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
#: every Hugging Face name, in the order targets resolve to
HF_ORDER: tuple[str, ...] = tuple(n for t in TARGETS for n in HF_NAMES[t])
#: column-parallel targets (output split over TP); the others are row-parallel
COLUMN = ("linear_qkv", "linear_fc1")
#: the submodule of a decoder layer that holds each target
MODULE_OF = {"linear_qkv": "self_attention", "linear_proj": "self_attention",
             "linear_fc1": "mlp", "linear_fc2": "mlp"}


def resolve_targets(names: list[str]) -> tuple[str, ...]:
    """Target names as a user writes them -> the Hugging Face projections they adapt,
    in :data:`HF_ORDER`. Accepts megatron's names (a fused layer: all its parts), PEFT's
    (any subset of a fused layer's parts) and ``all-linear``. Raises ValueError
    (pydantic names the field) on a name that matches no layer.

    ``["v_proj", "q_proj", "linear_fc2"]`` -> ``("q_proj", "v_proj", "down_proj")``.
    """
    if not names:
        raise ValueError("no target modules: name at least one of " + ", ".join(TARGETS)
                         + " (or their PEFT names, or all-linear)")
    out: set[str] = set()
    for n in names:
        if n == "all-linear":
            out.update(HF_ORDER)
        elif n in TARGETS:
            out.update(HF_NAMES[n])
        elif n in HF_TARGETS:
            out.add(n)
        else:
            raise ValueError(f"target module {n!r} matches no layer of a LLaMA-family "
                             f"decoder; allowed: {', '.join(TARGETS)}, "
                             f"{', '.join(HF_TARGETS)} or all-linear")
    return tuple(n for n in HF_ORDER if n in out)


def part_rows(spec: ModelSpec, target: str, tp: int = 1) -> tuple[int, tuple[int, ...]]:
    """(groups, rows of each part per group) of a target's output rows on one TP rank of
    ``tp``, in megatron's order: the rows are ``groups`` repetitions of the parts' blocks.

    linear_qkv: one group per query group, ``[q: heads/group * d, k: d, v: d]`` (TP splits
    the groups); linear_fc1: one group ``[gate: ffn/tp, up: ffn/tp]``; the row-parallel
    targets: one group of one part. LLaMA-2 70B (8 query groups of 8 heads, d 128) at
    tp 2: linear_qkv -> ``(4, (1024, 128, 128))``.
    """
    if target == "linear_qkv":
        d, groups = spec.kv_channels, spec.n_kv_heads
        return groups // tp, ((spec.n_heads // groups) * d, d, d)
    if target == "linear_fc1":
        return 1, (spec.ffn_hidden // tp, spec.ffn_hidden // tp)
    return 1, (target_dims(spec, target)[1],)


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
        HF_ORDER, description="Layers that get an adapter: PEFT's names (q_proj, k_proj, "
        "v_proj, o_proj, gate_proj, up_proj, down_proj; any subset), megatron's "
        "(linear_qkv = q_proj+k_proj+v_proj, linear_proj, linear_fc1 = gate_proj+up_proj, "
        "linear_fc2) or all-linear. Default: all seven. Held as PEFT's names.")
    shared_a: bool = Field(
        False, description="One A of rank r shared by the adapted parts of a fused layer "
        "(q/k/v, gate/up) instead of PEFT's A per part: fewer trained parameters than "
        "PEFT, and init_from then needs an adapter whose fused parts have equal A.")

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

    @property
    def targets(self) -> tuple[str, ...]:
        """megatron's layers that carry an adapter, in :data:`TARGETS` order."""
        return tuple(t for t in TARGETS if self.parts(t))

    def parts(self, target: str) -> tuple[str, ...]:
        """The adapted Hugging Face parts of ``target``, in megatron's order."""
        return tuple(n for n in HF_NAMES[target] if n in self.target_modules)

    def a_rows(self, target: str) -> int:
        """Rows of ``target``'s ``A``: rank per adapted part (rank with ``shared_a``)."""
        return self.rank * (1 if self.shared_a else len(self.parts(target)))

    def b_rows(self, spec: ModelSpec, target: str, tp: int = 1) -> int:
        """Rows of ``target``'s ``B`` on one TP rank: the adapted parts' output rows."""
        groups, rows = part_rows(spec, target, tp)
        return groups * sum(r for n, r in zip(HF_NAMES[target], rows)
                            if n in self.target_modules)

    def layer_tensors(self, spec: ModelSpec, layer: int) -> list[LogicalTensor]:
        """The adapter tensors of decoder layer ``layer`` (global number), named after
        the base weight's module: ``decoder.layers.3.mlp.linear_fc1.lora_A``. A fused
        layer's ``B`` splits over TP like its base (by query group; gate and up part by
        part)."""
        out = []
        for target in self.targets:
            k, _n = target_dims(spec, target)
            pre = f"decoder.layers.{layer}.{MODULE_OF[target]}.{target}."
            content = f"decoder.layers.{layer}.lora.{target}."
            r, a, b = self.rank, self.a_rows(target), self.b_rows(spec, target)
            if target in COLUMN:
                parts = len(self.parts(target)) if target == "linear_fc1" else 1
                out += [LogicalTensor(pre + "lora_A", (a, k), None, 1, content + "A", layer),
                        LogicalTensor(pre + "lora_B", (b, r), 0, parts, content + "B", layer)]
            else:
                out += [LogicalTensor(pre + "lora_A", (a, k), 1, 1, content + "A", layer),
                        LogicalTensor(pre + "lora_B", (b, r), None, 1, content + "B", layer)]
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
        """Trained adapter parameters of the whole model (PEFT's count for the same
        targets and rank, unless ``shared_a``)."""
        s, r = self.layer_params(spec)
        return spec.n_layers * (s + r)

    def gemms(self, spec: ModelSpec, tp: int) -> list[tuple[float, float]]:
        """(K, N) of one layer's adapter GEMMs on one TP rank: ``x A^T`` then ``z B^T``
        per target (the row-parallel ones read the rank's input slice; a fused layer's
        parts each multiply their own rank-wide block of ``z``, together one GEMM of
        K = rank over the adapted rows)."""
        out: list[tuple[float, float]] = []
        for target in self.targets:
            k, _n = target_dims(spec, target)
            if target in COLUMN:
                out += [(k, self.a_rows(target)), (self.rank, self.b_rows(spec, target, tp))]
            else:
                out += [(k / tp, self.rank), (self.rank, self.b_rows(spec, target))]
        return out

    def z_width(self) -> int:
        """Columns of ``x A^T`` summed over one layer's targets (what the backward keeps
        per token, and what the TP all-reduces of the adapters carry)."""
        return sum(self.a_rows(t) for t in self.targets)


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
    if lora is None:
        return stage_tensors(spec, head, pp, stage)
    return trained_stage_tensors(spec, head, lora, pp, stage)
