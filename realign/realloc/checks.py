"""Checks a reallocation's input before any message is sent, and the byte lower bound.

Every rank runs :func:`check_reallocation` on the same (spec, placements, world) and so
raises the same :class:`ReallocError` before the first send or receive: a bad input
never leaves a rank blocked in a receive. The shard dicts are rank-local; their
check (:func:`check_shards`) also runs before any message, but only on the rank that
holds them (see the executor's docstring).
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from planner.cost.transfer import Placement, held_tensors
from planner.specs.layout import coords_of_rank, ep_problems
from planner.specs.lora import LoraSpec
from planner.specs.model_spec import ModelSpec
from realign.errors import UserError

HEADS = ("lm", "value")


class ReallocError(UserError):
    """A reallocation's input is invalid; the message says which field and what is allowed."""


def placement_problems(spec: ModelSpec, p: Placement, n_gpus_world: int) -> list[str]:
    """Why placement ``p`` of ``spec`` cannot run in a world of ``n_gpus_world`` GPUs."""
    out = []
    lay, mesh = p.layout, p.mesh
    last = mesh.first_gpu + mesh.n_gpus - 1
    if last >= n_gpus_world:
        out.append(f"mesh GPUs {mesh.first_gpu}..{last} exceed the world's {n_gpus_world} "
                   f"ranks (GPUs 0..{n_gpus_world - 1})")
    if lay.world != mesh.n_gpus:
        out.append(f"tp*pp*dp = {lay.tp}*{lay.pp}*{lay.dp} = {lay.world} must equal the "
                   f"mesh size {mesh.n_gpus}")
    for what, n in (("heads", spec.n_heads), ("KV heads", spec.n_kv_heads),
                    ("ffn_hidden", spec.ffn_hidden), ("padded vocabulary", spec.padded_vocab)):
        if n % lay.tp:
            out.append(f"tp={lay.tp} must divide the {n} {what} of {spec.name}")
    if spec.n_layers % lay.pp:
        out.append(f"pp={lay.pp} must divide the {spec.n_layers} layers of {spec.name}")
    out += ep_problems(spec, lay.dp, lay.ep)
    return out


def check_reallocation(spec: ModelSpec, head: str, src: Placement, dst: Placement,
                       n_gpus_world: int) -> None:
    """Raise :class:`ReallocError` unless ``src -> dst`` is a valid reallocation."""
    if head not in HEADS:
        raise ReallocError(f"head {head!r} is not one of {HEADS}", field="head")
    for field, p in (("src", src), ("dst", dst)):
        probs = placement_problems(spec, p, n_gpus_world)
        if probs:
            raise ReallocError("; ".join(probs), field=field)


def expected_shards(spec: ModelSpec, head: str, p: Placement, gpu: int,
                    lora: LoraSpec | None = None) -> dict[str, tuple[int, ...]]:
    """Logical name -> local shard shape that ``gpu`` holds in ``p`` (empty if outside);
    ``lora``: of the tensors a LoRA reallocation moves."""
    if gpu not in p.mesh.gpus:
        return {}
    _tp_rank, dp_rank, pp_rank = coords_of_rank(gpu - p.mesh.first_gpu, p.layout)
    return {t.name: t.shard_shape(p.layout.tp)
            for t in held_tensors(spec, head, lora, p.layout, dp_rank, pp_rank)}


def check_shards(shards: Mapping[str, torch.Tensor] | None, expected: dict[str, tuple[int, ...]],
                 dtype: torch.dtype, field: str) -> None:
    """Raise :class:`ReallocError` unless ``shards`` has exactly the expected tensors."""
    got = dict(shards or {})
    missing = sorted(set(expected) - set(got))
    extra = sorted(set(got) - set(expected))
    if missing or extra:
        raise ReallocError(f"shard names differ from the placement's: missing {missing}, "
                           f"unexpected {extra}", field=field)
    for name, shape in expected.items():
        t = got[name]
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise ReallocError(f"{name} is {tuple(t.shape)} {t.dtype}; the placement needs "
                               f"{shape} {dtype}", field=f"{field}[{name!r}]")


# ---- the byte lower bound (independent of the transfer plan's sender choice) ----

def _minus(need: list[tuple[int, int]], held: list[tuple[int, int]]) -> int:
    """Length of the union of ``need`` minus the union of ``held`` (disjoint inputs)."""
    total = 0
    for a, b in need:
        covered = sum(max(0, min(b, d) - max(a, c)) for c, d in held)
        total += (b - a) - covered
    return total


def lower_bound_bytes(spec: ModelSpec, head: str, src: Placement, dst: Placement,
                      dtype_bytes: int, lora: LoraSpec | None = None) -> dict[int, int]:
    """Destination GPU -> bytes of its destination shards it does not hold in ``src``.

    No executor can move fewer bytes: each of them must arrive from another GPU.
    Computed from the layouts directly (interval arithmetic), not from a transfer plan.
    """
    out: dict[int, int] = {}
    for r in range(dst.mesh.n_gpus):
        g = dst.mesh.first_gpu + r
        i, d, j = coords_of_rank(r, dst.layout)
        held: dict[str, tuple] = {}
        if g in src.mesh.gpus:
            k, ds, js = coords_of_rank(g - src.mesh.first_gpu, src.layout)
            for t in held_tensors(spec, head, lora, src.layout, ds, js):
                held[t.content] = (t, k)
        lack = 0
        for t in held_tensors(spec, head, lora, dst.layout, d, j):
            if t.shard_dim is None:
                lack += 0 if t.content in held else t.numel * dtype_bytes
                continue
            per_index = t.numel // t.shape[t.shard_dim] * dtype_bytes
            need = t.shard_ranges(i, dst.layout.tp)
            have = (held[t.content][0].shard_ranges(held[t.content][1], src.layout.tp)
                    if t.content in held else [])
            lack += _minus(need, have) * per_index
        out[g] = lack
    return out
