"""Process groups of one model replica, built from the planner's mesh and layout.

A replica on mesh ``m`` with layout ``L`` occupies world ranks
``m.first_gpu .. m.first_gpu + m.n_gpus - 1`` (one process per GPU, world rank =
global GPU index); inside the mesh, ranks follow :mod:`planner.specs.layout` (tp fastest,
then dp, then pp). Example, tp-dp-pp 2-1-2 on GPUs 4-7 of an 8-rank world:
TP groups [[4,5],[6,7]], PP groups [[4,6],[5,7]], embedding groups [[4,6],[5,7]].

Creating a process group is a collective over the *whole world*: every rank must
call :func:`build_replica_groups` for every replica, in the same order, also ranks
outside the replica's mesh (they get a :class:`ReplicaGroups` with ``member=False``).
All checks run before the first group is created, so bad input raises on every rank
and no rank is left waiting in a collective.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch.distributed as dist

from planner.specs.layout import Layout, coords_of_rank, model_layout_problems, rank_of_coords
from planner.specs.mesh import DeviceMesh
from planner.specs.model_spec import ModelSpec
from realign.errors import UserError
from realign.runtime.ep_groups import (
    ep_coords,
    ep_rank_groups,
    expert_dp_groups,
    tp_ep_groups,
)

if TYPE_CHECKING:     # megatron-core ships no type information: this names an Any
    from megatron.core.process_groups_config import ProcessGroupCollection


@dataclass
class ReplicaGroups:
    """One replica's groups as seen by this process."""

    mesh: DeviceMesh
    layout: Layout
    rank_offset: int                 #: world rank of mesh rank 0
    member: bool                     #: this process holds a shard of the replica
    tp_rank: int = -1
    dp_rank: int = -1
    pp_rank: int = -1
    pgs: ProcessGroupCollection = None   #: megatron's process groups (members only)
    model_group: object = None       #: all tp*pp*dp ranks of the replica
    ep: int = 1                      #: expert-parallel degree (:mod:`realign.runtime.ep_groups`)
    ep_rank: int = 0                 #: this rank's place in its EP group
    ep_group: object = None          #: the EP group exchanging tokens (None at ep 1)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.layout.pp - 1

    def world_rank(self, tp_rank: int, dp_rank: int, pp_rank: int) -> int:
        """World rank of a coordinate of this replica."""
        return self.rank_offset + rank_of_coords(tp_rank, dp_rank, pp_rank, self.layout)


def check_replica(spec: ModelSpec, mesh: DeviceMesh, layout: Layout, world_size: int,
                  field: str = "allocation") -> None:
    """Raise :class:`UserError` if ``spec`` cannot run with ``layout`` on ``mesh`` in a
    world of ``world_size`` ranks. Pure: call it before any collective."""
    probs = []
    if mesh.first_gpu + mesh.n_gpus > world_size:
        probs.append(f"mesh GPUs {mesh.first_gpu}..{mesh.first_gpu + mesh.n_gpus - 1} exceed "
                     f"the world of {world_size} ranks (allowed: first_gpu + n_gpus <= "
                     f"{world_size})")
    if layout.world != mesh.n_gpus:
        probs.append(f"layout {layout} needs tp*pp*dp = {layout.world} ranks but the mesh "
                     f"has {mesh.n_gpus}")
    probs += model_layout_problems(layout, spec)    # layout.ep's rule among them
    if probs:
        raise UserError("; ".join(probs), field=field)


def grid_rank_enum(layout: Layout, rank_offset: int) -> dict[str, list[list[int]]]:
    """World ranks of every group kind of a replica (pure).

    With tp-dp-pp 2-2-2 at offset 0: tp [[0,1],[2,3],[4,5],[6,7]], dp [[0,2],[1,3],
    [4,6],[5,7]], pp [[0,4],[1,5],[2,6],[3,7]], mp (tp x pp) [[0,1,4,5],[2,3,6,7]],
    embd = first and last stage of each pp group, pos_embd = first stage, model = all.
    """
    def shift(groups):
        return [[rank_offset + r for r in g] for g in groups]

    t, d, p = layout.tp, layout.dp, layout.pp
    coords = [coords_of_rank(r, layout) for r in range(layout.world)]
    by = lambda key: _group_by(coords, key)  # noqa: E731
    pp = by(lambda c: (c[0], c[1]))
    return {
        "tp": shift(by(lambda c: (c[1], c[2]))),
        "dp": shift(by(lambda c: (c[0], c[2]))),
        "pp": shift(pp),
        "mp": shift(by(lambda c: (c[1],))),
        "embd": shift([[g[0], g[-1]] if len(g) > 1 else [g[0]] for g in pp]),
        "pos_embd": shift([[g[0]] for g in pp]),
        "cp": shift([[r] for r in range(t * d * p)]),
        "model": shift([list(range(t * d * p))]),
    }


def tp_ep_pp_groups(layout: Layout, ep: int) -> list[list[int]]:
    """TP x EP x PP groups in mesh ranks (megatron's ``tp_ep_pp``: the ranks that hold
    every expert of the model once, whose gradient norms add up). tp-dp-pp 2-4-1, ep 2
    -> [[0,1,2,3],[4,5,6,7]]; tp-dp-pp 1-2-2, ep 2 -> [[0,1,2,3]]."""
    coords = [coords_of_rank(r, layout) for r in range(layout.world)]
    return _group_by(coords, lambda c: (c[1] // ep,))


def _group_by(coords, key) -> list[list[int]]:
    groups: dict = {}
    for rank, c in enumerate(coords):
        groups.setdefault(key(c), []).append(rank)
    return sorted(groups.values())


def build_replica_groups(spec: ModelSpec, mesh: DeviceMesh, layout: Layout,
                         rank_offset: int | None = None) -> ReplicaGroups:
    """Create the replica's process groups. Collective over the whole world: every rank
    calls it with the same arguments. ``rank_offset`` defaults to ``mesh.first_gpu``.
    ``layout.ep`` > 1 (the plan's): expert parallelism inside the data-parallel ranks
    (the EP, expert-DP, TP x EP and TP x EP x PP groups become megatron's ``ep``,
    ``expt_dp``, ``tp_ep`` and ``tp_ep_pp``: DDP sums the experts' gradients over ``expt_dp``, the expert
    optimizer's gradient norm over ``tp_ep_pp``, where every expert is held once)."""
    world, me = dist.get_world_size(), dist.get_rank()
    offset = mesh.first_gpu if rank_offset is None else rank_offset
    shifted = DeviceMesh(first_gpu=offset, n_gpus=mesh.n_gpus)
    check_replica(spec, shifted, layout, world)
    ep = layout.ep
    from megatron.core.process_groups_config import ProcessGroupCollection

    enum = grid_rank_enum(layout, offset)
    if ep > 1:
        enum.update({kind: [[offset + r for r in g] for g in fn(layout, ep)] for kind, fn in
                     (("ep", ep_rank_groups), ("expt_dp", expert_dp_groups),
                      ("tp_ep", tp_ep_groups), ("tp_ep_pp", tp_ep_pp_groups))})
    mine = {kind: _new_groups(groups) for kind, groups in enum.items()}
    member = offset <= me < offset + mesh.n_gpus
    out = ReplicaGroups(mesh=mesh, layout=layout, rank_offset=offset, member=member)
    if not member:
        return out
    out.tp_rank, out.dp_rank, out.pp_rank = coords_of_rank(me - offset, layout)
    tp, cp, mp, dp = mine["tp"], mine["cp"], mine["mp"], mine["dp"]
    out.model_group = mine["model"]
    ep_pg, expt_dp, tp_ep, tp_ep_pp = cp, dp, tp, mp
    if ep > 1:
        out.ep, out.ep_group = ep, mine["ep"]
        out.ep_rank = ep_coords(out.dp_rank, ep)[0]
        ep_pg, expt_dp, tp_ep = mine["ep"], mine["expt_dp"], mine["tp_ep"]
        tp_ep_pp = mine["tp_ep_pp"]
    out.pgs = ProcessGroupCollection(
        tp=tp, pp=mine["pp"], mp=mp, embd=mine["embd"], pos_embd=mine["pos_embd"],
        cp=cp, tp_cp=tp, ep=ep_pg, expt_tp=tp, tp_ep=tp_ep, tp_ep_pp=tp_ep_pp,
        tp_dp_cp=mine["model"], dp=dp, dp_cp=dp, expt_dp=expt_dp, intra_dp_cp=dp,
        intra_expt_dp=expt_dp, intra_dist_opt=mine["model"], inter_dist_opt=None)
    return out


class _GroupRegistry:
    """The process groups made so far in this process's world, by their exact rank list
    (this rank's group, or None where it is not a member).

    Why a registry: torch's ``new_group`` makes a new communicator on every call, even
    for a rank list that has one already, and each gloo group keeps its own threads (an
    NCCL one its own GPU buffers). Replicas on the same GPUs with the same layout (an
    actor and its reference, a model rebuilt at a layout it had before, a profile's
    repeated builds) share their groups instead. Every rank calls ``get`` with the same
    lists in the same order, so every rank decides alike whether to create (a
    collective) or to reuse. The registry is process-global state because c10d's groups
    are: it follows the default group and starts afresh when the world is re-made."""

    def __init__(self) -> None:
        self.world: object | None = None
        self.groups: dict[tuple[int, ...], object | None] = {}

    def get(self, ranks: list[int]):
        world = dist.group.WORLD
        if world is not self.world:         # a new world: the old groups are gone
            self.world, self.groups = world, {}
        key = tuple(ranks)
        if key not in self.groups:
            pg = dist.new_group(ranks=ranks)
            self.groups[key] = pg if dist.get_rank() in key else None
        return self.groups[key]


_REGISTRY = _GroupRegistry()


def _new_groups(groups: list[list[int]]):
    """The process groups for ``groups`` (every world rank calls this; a rank list made
    before is reused); return the one holding this rank, or None."""
    me, found = dist.get_rank(), None
    for ranks in groups:
        pg = _REGISTRY.get(ranks)
        if me in ranks:
            found = pg
    return found
