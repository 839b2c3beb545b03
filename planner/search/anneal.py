"""Simulated annealing over candidate assignments: the Python twin of the C++ core.

:func:`anneal` here and ``anneal`` in ``csrc/anneal.cpp`` run the same loop with
the same random numbers (SplitMix64) and the same floating-point operations, so
for the same problem, start and settings they return the same assignment and the
same energy; a test checks it on random problems. The C++ one is what the search
uses; this one is the readable reference.

One step: pick an MFC, propose a new candidate for it (half the time one on the
same mesh, i.e. a layout change; otherwise any candidate), simulate, and accept by
the Metropolis rule at a temperature that falls geometrically from
``t0_frac * E0`` to ``t1_frac * E0``. Every ``restart_every`` steps the walk
returns to the best feasible assignment found so far. With ``patience`` > 0 it stops
once that many steps have found no better plan (converged: an anytime search that
ends when more steps no longer pay, not at the time limit).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from planner.search.problem import Problem
from planner.search.simulator import ReallocCache, energy, simulate

MASK64 = (1 << 64) - 1


class SplitMix64:
    """The SplitMix64 generator (same constants as the C++ twin)."""

    def __init__(self, seed: int):
        self.state = seed & MASK64

    def next(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & MASK64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        return z ^ (z >> 31)

    def uniform(self) -> float:
        """A double in [0, 1) from the top 53 bits."""
        return (self.next() >> 11) * (1.0 / 9007199254740992.0)


@dataclass(frozen=True)
class AnnealSettings:
    n_steps: int = 20000
    t0_frac: float = 0.05
    t1_frac: float = 1e-4
    restart_every: int = 5000
    seed: int = 0
    patience: int = 0


@dataclass
class AnnealResult:
    assign: list[int]
    energy: float
    feasible: bool
    steps: int
    accepted: int


def anneal(prob: Problem, start: list[int], s: AnnealSettings,
           cache: ReallocCache | None = None) -> AnnealResult:
    rng = SplitMix64(s.seed)
    cache = cache if cache is not None else ReallocCache(prob)
    cur = list(start)
    res = simulate(prob, cur, cache)
    cur_e = energy(prob, res)
    best = list(cur)
    best_e = cur_e if res.feasible else math.inf
    t0 = s.t0_frac * cur_e
    t1 = s.t1_frac * cur_e
    n_mfc = len(prob.cands)
    accepted = 0
    improved_at = 0                  # the step of the last better plan (the start: 0)
    steps = s.n_steps
    for step in range(s.n_steps):
        if s.patience > 0 and step - improved_at >= s.patience:
            steps = step                                                     # converged
            break
        if s.restart_every > 0 and step > 0 and step % s.restart_every == 0 and best_e < math.inf:
            cur = list(best)
            cur_e = best_e
        temp = t0 * math.pow(t1 / t0, step / s.n_steps)
        i = rng.next() % n_mfc
        same = prob.same_mesh[i][cur[i]]
        if (rng.next() & 1) and len(same) > 1:
            c = same[rng.next() % len(same)]
        else:
            c = rng.next() % len(prob.cands[i])
        if c == cur[i]:
            continue
        old = cur[i]
        cur[i] = c
        r = simulate(prob, cur, cache)
        e = energy(prob, r)
        if e <= cur_e or rng.uniform() < math.exp((cur_e - e) / temp):
            cur_e = e
            accepted += 1
            if r.feasible and e < best_e:
                best_e = e
                best = list(cur)
                improved_at = step
        else:
            cur[i] = old
    return AnnealResult(best, best_e, best_e < math.inf, steps, accepted)
