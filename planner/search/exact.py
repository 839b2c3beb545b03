"""Exact search: depth-first branch and bound over the candidates of each MFC.

MFCs are assigned in graph order, each one's candidates fastest first. A partial
assignment (MFCs ``0 .. k-1``) is simulated alone: its makespan and its memory are
lower bounds of every completion (adding tasks to a list schedule only delays
others; adding calls only adds memory), so a branch whose bound already reaches
the incumbent, or already overflows memory, is cut. Returns the optimum of the
same cost model the annealer uses; a test checks it against brute force.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from planner.search.deadline import Deadline
from planner.search.problem import Problem
from planner.search.simulator import ReallocCache, simulate


@dataclass
class ExactResult:
    assign: list[int] | None
    iter_time_s: float
    nodes: int
    complete: bool    #: False when the node budget ran out (result is the incumbent)


def branch_and_bound(prob: Problem, incumbent: list[int] | None = None,
                     max_nodes: int = 2_000_000, deadline: Deadline | None = None
                     ) -> ExactResult:
    """The best assignment (or the incumbent) within ``max_nodes`` nodes and before
    ``deadline``; ``complete`` says whether the whole space was searched."""
    cache = ReallocCache(prob)
    n = len(prob.cands)
    best: list[int] | None = None
    best_t = math.inf
    if incumbent is not None:
        r = simulate(prob, incumbent, cache)
        if r.feasible:
            best, best_t = list(incumbent), r.iter_time_s
    order = [sorted(range(len(cs)), key=lambda j: (cs[j].time_s, j)) for cs in prob.cands]
    # Area bound: every MFC occupies (time x GPUs) of the cluster each iteration.
    area = [[c.time_s * c.n_gpus for c in cs] for cs in prob.cands]
    rest_min = [0.0] * (n + 1)
    for k in range(n - 1, -1, -1):
        rest_min[k] = rest_min[k + 1] + min(area[k])
    scale = 1.0 / prob.n_gpus  # iteration time >= per-iteration busy area / GPUs
    assign = [0] * n
    nodes = 0
    complete = True

    def visit(k: int, used: float) -> None:
        nonlocal best, best_t, nodes, complete
        for j in order[k]:
            if (used + area[k][j] + rest_min[k + 1]) * scale >= best_t:
                continue
            if nodes >= max_nodes or (deadline is not None and nodes % 256 == 0
                                      and deadline.passed()):
                complete = False
                return
            nodes += 1
            assign[k] = j
            r = simulate(prob, assign, cache, upto=k + 1)
            if not r.feasible or r.iter_time_s >= best_t:
                continue
            if k + 1 == n:
                best, best_t = list(assign), r.iter_time_s
            else:
                visit(k + 1, used + area[k][j])

    visit(0, 0.0)
    return ExactResult(best, best_t, nodes, complete)
