"""Reallocate one replica's parameters into another replica's :class:`ModelShard`.

The glue between the runtime (models on meshes) and the reallocation executor: a
replica's placement is its mesh shifted to its world ranks (world rank = global GPU
index, as :mod:`realign.runtime.groups` lays replicas out), its shards are
:func:`realign.runtime.model.logical_shards` (views of the parameters, so the
destination model is written in place), and the bytes moved are exactly those the
planner prices (:func:`planner.cost.transfer.transfer_plan`).

Typical use in an RLHF iteration: the actor trains at A, is reallocated into a
generation copy at B, B generates, then :func:`release_copy` frees B's storage;
before the next reallocation into B, :func:`realign.realloc.offload.restore` gives it
back. A's parameters are only read, so A keeps its values and its optimizer state.
"""
from __future__ import annotations

import torch

from planner.cost.transfer import Placement
from planner.specs.lora import LoraSpec
from planner.specs.mesh import DeviceMesh
from planner.specs.model_spec import ModelSpec
from realign.realloc import offload
from realign.realloc.executor import ReallocStats, reallocate
from realign.runtime.groups import ReplicaGroups
from realign.runtime.model import Head, ModelShard, logical_shards


def placement_of(groups: ReplicaGroups) -> Placement:
    """The replica's placement in world ranks: TP2 on a mesh of GPUs 0-1 built at
    ``rank_offset=2`` -> ``Placement(DeviceMesh(first_gpu=2, n_gpus=2), tp2)``."""
    return Placement(DeviceMesh(first_gpu=groups.rank_offset, n_gpus=groups.mesh.n_gpus),
                     groups.layout)


def shard_tensors(shard: ModelShard | None) -> dict[str, torch.Tensor] | None:
    """This rank's logical shards of ``shard`` that a reallocation moves (None for a
    rank outside the replica): every parameter, or a LoRA model's adapters (and value
    head) only."""
    if shard is None:
        return None
    g = shard.groups
    return logical_shards(shard, g.layout, g.pp_rank, moved=True)


def reallocate_replica(spec: ModelSpec, head: Head, src: ReplicaGroups, dst: ReplicaGroups,
                       src_shard: ModelShard | None, dst_shard: ModelShard | None, *,
                       dtype: torch.dtype, gpus_per_node: int,
                       planned: tuple[int, int] | None = None,
                       lora: LoraSpec | None = None) -> ReallocStats:
    """Copy the parameters of replica ``src`` into replica ``dst`` (written in place).

    Call on every rank of ``src ∪ dst`` (others may call it and return at once), with
    this rank's shard of each replica or None where it is not a member. ``dtype``: the
    parameters' dtype (the same on every rank). Messages go over the default (world)
    group, point to point only. ``planned``: (bytes, bytes per element) the execution
    plan priced it at, checked against what moves. ``lora``: the model's LoRA settings
    (the same on every rank): only its adapters (and value head) move, the frozen base
    already being in place on both sides. Returns this rank's byte counts.
    """
    for name, g, shard in (("src", src, src_shard), ("dst", dst, dst_shard)):
        if g.member != (shard is not None):
            raise ValueError(f"{name}_shard must be given exactly on the ranks of replica "
                             f"{name} (member={g.member}, shard given={shard is not None})")
    return reallocate(spec, head, placement_of(src), placement_of(dst),
                      shard_tensors(src_shard), shard_tensors(dst_shard), dtype=dtype,
                      gpus_per_node=gpus_per_node, planned=planned, lora=lora)


def release_copy(shard: ModelShard | None) -> offload.Released | None:
    """Free the storage of a reallocated copy's parameters (values are lost); give it
    back with :func:`realign.realloc.offload.restore` before refilling it. A LoRA copy
    frees only its adapters: its frozen base stays (the planner counts it resident)."""
    if shard is None:
        return None
    if shard.lora is not None:
        g = shard.groups
        return offload.release(logical_shards(shard, g.layout, g.pp_rank, moved=True).values())
    return offload.release(shard.module.parameters())
