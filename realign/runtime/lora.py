"""LoRA adapters on a replica's megatron layers, in both of realign's forwards.

:func:`attach_lora` gives each targeted linear layer (``linear_qkv``, ``linear_proj``,
``linear_fc1``, ``linear_fc2``: :mod:`planner.specs.lora`) two new parameters,
``lora_A`` and ``lora_B``, sharded as the planner's logical tensors say (a
column-parallel layer's B split by output, a row-parallel layer's A split by input, the
other factor whole on every TP rank), and freezes everything else but a value head. A
fused layer (q/k/v, gate/up) carries PEFT's adapters of its adapted parts: ``A`` is
their ``A`` stacked ([parts * rank, in]), ``B`` their output rows in megatron's order,
each part's rows reading its own rank-wide block of ``x A^T`` (:func:`fused_out`). The
update ``scale * B A x`` (:func:`lora_delta`) is added

* in megatron's ``GPTModel`` forward by a forward hook on the layer (training with
  ``train.forward: megatron``), and
* in the plain decoder (:mod:`realign.runtime.engines.decoder`: scoring, generation and
  training with the default forward), which reads the same parameters.

Why not PEFT's layers: PEFT wraps ``torch.nn.Linear`` modules (its megatron support
targets megatron-LM's global parallel state and replaces the module, renaming the base
weight), while realign keeps megatron's parameter names (the planner's tensors,
checkpoints and reallocations are keyed by them) and runs a second forward that reads
parameters directly. PEFT stays the reference: the adapters are written and read in its
format (:mod:`realign.runtime.lora_peft`) and a test checks loss and gradients against it.

Generation uses this LoRA-aware forward, not merged weights: merging would rewrite every
adapted base weight of the generating copy each step (and need a pristine base to
unmerge from, or drift in bf16), while the unmerged forward keeps the frozen base bit
for bit and costs two rank-r GEMMs per layer; so a reallocation moves only the adapters.

TP arithmetic (``x`` the layer's input, ``z = x A^T`` of width rank):
column-parallel: ``x`` and ``A`` are whole, so ``z`` is too; each rank's ``B`` rows give
its output slice; ``z``'s gradient is summed over TP in the backward
(megatron's ``copy_to_tensor_model_parallel_region``) so ``A`` gets the full gradient on
every rank. Row-parallel: each rank holds an input slice and the matching columns of
``A``: ``z`` is the sum of the ranks' partial products (all-reduce, megatron's
``reduce_from_tensor_model_parallel_region``), then ``B`` (whole) maps it to the full
output. Either way the replicated factor's gradient is the same on every TP rank.

Dropout (``lora.<role>.dropout``, while gradients are on: training) draws its masks
from torch's default generator, which :func:`seed_dropout` seeds from the run's seed, the
step and the role before each train call: every rank of the replica then draws the same
numbers in the same order, a resumed run draws what the uninterrupted one did, and
recomputation (torch's and megatron's checkpoints restore the generator) draws the
forward's masks again. A row-parallel layer draws the mask of its whole input and keeps
its own columns, so the masks are those of TP 1 at any TP.

Adapters off (:func:`adapters_disabled`): a call that scores the frozen base (the
reference as the actor's base, the reward model as the critic's:
:mod:`planner.graph.shared_base`) skips every adapter's update, so the base's forward runs
as if no adapter were attached (not ``+ 0``: the same operations as a model without LoRA,
bit for bit); a value model also scores with the head its checkpoint held
(:attr:`base_head`, a frozen copy kept beside the head it trains).
"""
from __future__ import annotations

import contextlib
import math
import zlib
from collections.abc import Iterator
from typing import Protocol, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F

from planner.specs.lora import COLUMN, HF_NAMES, MODULE_OF, LoraSpec, part_rows, target_dims

LORA_PARAMS = ("lora_A", "lora_B")

#: :func:`part_plan`'s output: (groups, ``(rows, block)`` per part of a group)
Parts = tuple[int, tuple[tuple[int, int | None], ...]]


class AdaptedLayer(Protocol):
    """The attributes :func:`attach_lora` gives an adapted megatron linear layer."""

    weight: torch.Tensor                #: the frozen base weight
    lora_A: torch.nn.Parameter
    lora_B: torch.nn.Parameter
    lora_parts: Parts
    lora_column: bool                   #: column-parallel (else row-parallel)
    lora_off: bool                      #: adapter skipped (:func:`adapters_disabled`)
    lora_scale: float
    lora_rank: int
    lora_dropout: float
    lora_tp_group: dist.ProcessGroup | None
    lora_tp: int
    lora_tp_rank: int
    lora_hooked: bool                   #: :func:`_megatron_hook` registered


def adapter(mod: torch.nn.Module) -> AdaptedLayer:
    """``mod`` (a layer :func:`attach_lora` adapted) through its adapter attributes."""
    # torch types a module's dynamic attributes Tensor | Module: these are attach_lora's
    return cast(AdaptedLayer, mod)


def is_lora_name(name: str) -> bool:
    """A megatron parameter name of an adapter (``...linear_qkv.lora_A``)."""
    return name.rsplit(".", 1)[-1] in LORA_PARAMS


def init_seed(seed: int, layer: int, target: str) -> int:
    """The seed of one adapter's ``A``: the run's seed, the global layer, the target
    (the same on every TP rank and every layout, so a replica's adapters are the same
    whatever its layout)."""
    return zlib.crc32(f"{seed}:{layer}:{target}".encode())


def initial_a(lora: LoraSpec, spec, layer: int, target: str, seed: int) -> torch.Tensor:
    """The full initial ``A`` [A's rows, in] in fp32: PEFT's default for each part,
    Kaiming-uniform with ``a = sqrt(5)``, i.e. uniform in ``±1/sqrt(in)`` (``B`` starts
    at zero, so the model starts as its base)."""
    k, _n = target_dims(spec, target)
    g = torch.Generator().manual_seed(init_seed(seed, layer, target))
    bound = 1.0 / math.sqrt(k)
    return (torch.rand(lora.a_rows(target), k, generator=g, dtype=torch.float64) * 2 - 1
            ).mul(bound).float()


def part_plan(lora: LoraSpec, spec, target: str, tp: int) -> Parts:
    """How a column-parallel target's local output is made from ``x A^T``: (groups,
    ``(rows, block)`` per part of a group in megatron's order), ``block`` the part's
    rank-wide block of ``x A^T`` (0 for every part with ``shared_a``), None for a part
    without adapter (its rows get no update).

    q_proj and v_proj of a model with 2 query groups of 2 heads of 8 at tp 1:
    ``(2, ((16, 0), (8, None), (8, 1)))``.
    """
    groups, rows = part_rows(spec, target, tp)
    adapted = lora.parts(target)
    out = []
    for name, n in zip(HF_NAMES[target], rows):
        block = None
        if name in adapted:
            block = 0 if lora.shared_a else adapted.index(name)
        out.append((n, block))
    return groups, tuple(out)


def target_module(layer: torch.nn.Module, target: str) -> torch.nn.Module:
    return getattr(getattr(layer, MODULE_OF[target]), target)


def attach_lora(shard, lora: LoraSpec, seed: int) -> None:
    """Give ``shard`` (a :class:`realign.runtime.model.ModelShard`) its adapters and
    freeze its base: afterwards only the adapters (and a value head) require gradients.
    Collective-free; the adapters start as :func:`initial_a` and zero ``B``."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    from planner.specs.layout import stage_layers

    g, spec = shard.groups, shard.spec
    tp, tp_rank = g.layout.tp, g.tp_rank
    dtype, device = shard.device.dtype, shard.device.device
    for p in shard.module.parameters():
        p.requires_grad_(False)
    if shard.head == "value" and g.is_last_stage:
        head = shard.module.output_layer.weight
        # the checkpoint's head, kept for scoring with the adapters off (the reward model
        # as the critic's base): [1, hidden], the head it trains starts equal to it
        shard.base_head = head.detach().clone()
        head.requires_grad_(True)       # a new head: trained
    layers = stage_layers(spec.n_layers, g.layout.pp, g.pp_rank)
    for local, layer in enumerate(shard.module.decoder.layers):
        glob = layers[local]
        for target in lora.targets:
            mod = target_module(layer, target)
            ad = adapter(mod)
            k, _n = target_dims(spec, target)
            a_full = initial_a(lora, spec, glob, target, seed)
            if target in COLUMN:
                a = a_full
                b = torch.zeros(lora.b_rows(spec, target, tp), lora.rank)
                ad.lora_parts = part_plan(lora, spec, target, tp)
            else:
                a = a_full[:, tp_rank * k // tp:(tp_rank + 1) * k // tp]
                b = torch.zeros(lora.b_rows(spec, target), lora.rank)
                ad.lora_parts = (1, ((b.shape[0], 0),))
            ad.lora_A = torch.nn.Parameter(a.to(device=device, dtype=dtype).contiguous())
            ad.lora_B = torch.nn.Parameter(b.to(device=device, dtype=dtype))
            if target in COLUMN:
                set_tensor_model_parallel_attributes(ad.lora_B, True, 0, 1)
            else:
                set_tensor_model_parallel_attributes(ad.lora_A, True, 1, 1)
            ad.lora_column = target in COLUMN
            ad.lora_off = False
            ad.lora_scale, ad.lora_rank = lora.scale, lora.rank
            ad.lora_dropout = lora.dropout
            ad.lora_tp_group = g.pgs.tp if tp > 1 else None
            ad.lora_tp, ad.lora_tp_rank = tp, tp_rank
            if not getattr(mod, "lora_hooked", False):
                mod.register_forward_hook(_megatron_hook)
                ad.lora_hooked = True
    if g.is_first_stage and not getattr(shard.module.embedding, "lora_hooked", False):
        # megatron's full-layer recomputation is a reentrant checkpoint: a layer whose
        # inputs need no gradient (the frozen embedding's output) would lose its
        # adapters' gradients (PEFT's enable_input_require_grads does the same)
        shard.module.embedding.register_forward_hook(_input_needs_grad)
        shard.module.embedding.lora_hooked = True
    shard.lora = lora
    shard.decoder_weights = None        # the plain decoder's view picks the adapters up


def _input_needs_grad(mod, args, output):
    if torch.is_grad_enabled() and not output.requires_grad:
        output.requires_grad_(True)
    return output


def lora_delta(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``scale * B A dropout(x)`` of one adapted layer, on this TP rank: its output slice
    for a column-parallel layer, the full output for a row-parallel one (``x``: the
    layer's input on this rank, any leading dimensions)."""
    mod = adapter(layer)
    group = mod.lora_tp_group
    grad = torch.is_grad_enabled()
    if mod.lora_dropout > 0 and grad:
        x = _dropout(x, mod)
    z = F.linear(x, mod.lora_A)
    if group is not None:
        from megatron.core.tensor_parallel.mappings import (
            copy_to_tensor_model_parallel_region,
            reduce_from_tensor_model_parallel_region,
        )
        if mod.lora_column:
            if grad:
                z = copy_to_tensor_model_parallel_region(z, group)
        elif grad:
            z = reduce_from_tensor_model_parallel_region(z, group)
        else:
            dist.all_reduce(z, group=group)
    return fused_out(z, mod.lora_B, mod.lora_parts, mod.lora_rank) * mod.lora_scale


def fused_out(z: torch.Tensor, b: torch.Tensor, parts: Parts, rank: int) -> torch.Tensor:
    """``B``'s output of ``z = x A^T`` (any leading dimensions) on one TP rank, ``parts``
    as :func:`part_plan` gives them: each adapted part's rows of ``B`` times its block of
    ``z``, zeros for a part without adapter, laid out in megatron's row order. One GEMM
    when every part reads the same block (one part, or ``shared_a``)."""
    groups, plan = parts
    if all(block == 0 for _n, block in plan):
        return F.linear(z, b)
    lead = z.shape[:-1]
    bg = b.view(groups, -1, rank)
    outs, row = [], 0
    for n, block in plan:
        if block is None:
            outs.append(z.new_zeros(*lead, groups, n))
            continue
        bp = bg[:, row:row + n].reshape(groups * n, rank)
        row += n
        zp = z[..., block * rank:(block + 1) * rank]
        outs.append(F.linear(zp, bp).view(*lead, groups, n))
    return torch.cat(outs, -1).reshape(*lead, -1)


def delta_weight(layer: torch.nn.Module) -> torch.Tensor:
    """``scale * B A`` of one adapted layer on this TP rank (fp32), shaped like the
    rank's base weight: what merging adds to it."""
    mod = adapter(layer)
    a, b = mod.lora_A.float(), mod.lora_B.float()
    return fused_out(a.t(), b, mod.lora_parts, mod.lora_rank).t() * mod.lora_scale


def _dropout(x: torch.Tensor, mod: AdaptedLayer) -> torch.Tensor:
    """Inverted dropout on an adapter's input with the masks TP 1 would draw: a
    row-parallel layer draws its whole input's and keeps its own columns."""
    p, tp = mod.lora_dropout, mod.lora_tp
    if mod.lora_column or tp == 1:
        u = torch.rand(x.shape, dtype=torch.float32, device=x.device)
    else:
        w = x.shape[-1]
        u = torch.rand(*x.shape[:-1], w * tp, dtype=torch.float32, device=x.device)
        u = u[..., mod.lora_tp_rank * w:(mod.lora_tp_rank + 1) * w]
    return x * (u >= p).to(x.dtype) / (1.0 - p)


def seed_dropout(shard, seed: int, step: int, role: str) -> None:
    """Before a train call of a LoRA model with dropout: seed torch's default generator
    from (run seed, step, role), the same on every rank (nothing else in a run draws
    from it: sampling hashes its own noise)."""
    lora = getattr(shard, "lora", None)
    if lora is not None and lora.dropout > 0:
        torch.manual_seed(zlib.crc32(f"lora-dropout:{seed}:{step}:{role}".encode()))


def _megatron_hook(mod, args, output):
    """Forward hook on megatron's ``ColumnParallelLinear`` / ``RowParallelLinear``:
    ``(out, bias) -> (out + delta, bias)``."""
    out, bias = output
    if mod.lora_off:
        return output
    return out + lora_delta(mod, args[0]), bias


@contextlib.contextmanager
def adapters_disabled(shard) -> Iterator[None]:
    """Within: ``shard`` computes its frozen base, every adapter's update skipped and a
    value model's head the checkpoint's (:attr:`base_head`); the trained tensors are
    untouched and back in use afterwards. Collective-free; a no-op without LoRA."""
    if getattr(shard, "lora", None) is None:
        yield
        return
    mods = [adapter(m) for layer in shard.module.decoder.layers
            for m in adapted(layer).values()]
    base_head = getattr(shard, "base_head", None)
    head = shard.module.output_layer.weight if base_head is not None else None
    trained = head.data if head is not None else None
    try:
        for m in mods:
            m.lora_off = True
        if head is not None:
            head.data = base_head
        yield
    finally:
        for m in mods:
            m.lora_off = False
        if head is not None:
            head.data = trained


def adapted(layer: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The targets of a megatron ``TransformerLayer`` that carry adapters, by target."""
    out = {}
    for target in MODULE_OF:
        mod = target_module(layer, target)
        if getattr(mod, "lora_A", None) is not None:
            out[target] = mod
    return out


def trained_params(shard) -> dict[str, torch.nn.Parameter]:
    """The parameters a LoRA shard trains and checkpoints (adapters and a value head),
    by megatron name; every parameter without LoRA."""
    return {n: p for n, p in shard.module.named_parameters()
            if getattr(shard, "lora", None) is None or p.requires_grad}


def trained_state(shard) -> dict[str, torch.Tensor]:
    """What a checkpoint keeps of ``shard``: its whole state dict, or with LoRA only the
    trained tensors (the frozen base is referenced by the run's ``models.<role>``, not
    copied)."""
    if getattr(shard, "lora", None) is None:
        return shard.module.state_dict()
    return {n: p.detach() for n, p in trained_params(shard).items()}


def load_trained_state(shard, state: dict[str, torch.Tensor], where: str) -> None:
    """Load :func:`trained_state`'s output back (exactly the same names)."""
    from realign.errors import UserError

    if getattr(shard, "lora", None) is None:
        shard.module.load_state_dict(state)
        return
    mine = trained_params(shard)
    if set(mine) != set(state):
        raise UserError(f"{where} holds {sorted(set(state) - set(mine))[:3]} and lacks "
                        f"{sorted(set(mine) - set(state))[:3]} of this LoRA model's trained "
                        "tensors: it was written with other lora settings", field="lora")
    with torch.no_grad():
        for n, p in mine.items():
            p.copy_(state[n])
