"""A call's candidates as the pricing makes them: for each mesh size, the allocations
priced once (on the size's first mesh) and the meshes of that size they are copied
onto, in order. :func:`planner.search.problem.build_problem` records them beside the
candidates, so that what is the same on every mesh of a size is worked out once per
size, not once per candidate (420,000 candidates at 1024 GPUs).

A call's candidates are its blocks in order, each block mesh by mesh: block
``(priced, firsts)`` stands for ``[c.at(f) for f in firsts for c in priced]``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from planner.search.problem import Candidate

#: one mesh size of one call: its priced allocations, and the first GPUs of its meshes
Block = tuple[list["Candidate"], list[int]]


def mesh_groups(blocks: list[Block]) -> tuple[list[list[int]], dict[tuple[int, int], list[int]]]:
    """(per candidate: the candidates on its mesh, one list shared by all of them; per
    mesh (first_gpu, n_gpus): that list) of a call with these blocks: what
    :func:`planner.search.problem.assemble` finds by grouping the candidates.

    Example: one block of 2 priced allocations of 4 GPUs on the meshes at 0 and 4:
    ([[0, 1], [0, 1], [2, 3], [2, 3]], {(0, 4): [0, 1], (4, 4): [2, 3]})."""
    same: list[list[int]] = []
    on: dict[tuple[int, int], list[int]] = {}
    at = 0
    for priced, firsts in blocks:
        if not priced:
            continue
        n = len(priced)
        size = priced[0].n_gpus
        for first in firsts:
            group = list(range(at, at + n))
            on[(first, size)] = group
            same += [group] * n
            at += n
    return same, on


def columns(blocks: list[Block]) -> tuple[list[list[float]], list[list[int]], list[int]]:
    """The fields the C++ core reads of a call's candidates, a column each, in the order
    of ``(first_gpu, n_gpus, tp, pp, dp, time_s, resident_bytes, activation_bytes,
    weights_bytes, time_sd_s, ep)``, then each mesh's group of candidates once and per
    candidate its group's index (:func:`planner.search.core_bridge.to_core`'s packing)."""
    cols: list[list[float]] = [[] for _ in range(11)]
    groups: list[list[int]] = []
    group_of: list[int] = []
    at = 0
    for priced, firsts in blocks:
        if not priced or not firsts:
            continue
        n, m = len(priced), len(firsts)
        proto = list(zip(*[(c.n_gpus, c.tp, c.pp, c.dp, float(c.time_s),
                            float(c.resident_bytes), float(c.activation_bytes),
                            float(c.weights_bytes), float(c.time_sd_s), c.ep) for c in priced]))
        cols[0] += [f for f in firsts for _ in range(n)]
        for k, values in enumerate(proto, start=1):
            cols[k] += list(values) * m
        for _ in firsts:
            group_of += [len(groups)] * n
            groups.append(list(range(at, at + n)))
            at += n
    return cols, groups, group_of


def first_min(blocks: list[Block], key: Callable[["Candidate"], Any]) -> int:
    """The index of a call's first candidate with the least ``key`` (what
    ``min(range(len(cands)), key=...)`` returns), for a key that does not read the
    candidate's first GPU: each priced allocation is read once, on its first mesh.

    Example: blocks ([a, b], [0, 4]) and ([c], [0]) with keys 3, 1, 1: index 1 (b on the
    mesh at 0; b on the mesh at 4 is index 3, c index 4)."""
    best, best_key, at = -1, None, 0
    for priced, firsts in blocks:
        if not priced or not firsts:
            continue
        for j, c in enumerate(priced):
            k = key(c)
            if best_key is None or k < best_key:
                best, best_key = at + j, k
        at += len(priced) * len(firsts)
    if best < 0:
        raise ValueError("a call without candidates")
    return best
