"""A deterministic local search that finishes the annealer's best plan.

Annealing walks end in plans that no single move improves but that differ from seed to
seed: the common trap is a pair of calls that would each be faster on their own half of
a mesh, where moving one alone only makes it slower (the two trainings of a PPO on the
two halves of a node against both on the whole node). :func:`polish` climbs from a plan
with three kinds of move, best improvement first, until none improves it:

* **one call, another layout**: every candidate of one MFC on the mesh it runs on (or,
  where an MFC has at most :data:`FULL_SCAN_CANDIDATES` candidates, every candidate);
* **two calls, their meshes together**: for each pair of MFCs, both on one mesh or on
  the two halves of it (either way round), for the meshes the pair runs on and the
  meshes just above them, each call taking one of its :data:`PAIR_OPTIONS` fastest and
  leanest candidates there;
* **two pairs trading meshes** (either way round within each pair), each call taking
  its fastest or leanest candidate on its new mesh;
* **a restart on equal parts** (:func:`_best_parts`): the cluster cut into
  :data:`PARTS` equal parts, each training call on one of them, and the other calls kept,
  or on the whole cluster, or with their model's training; every call that moves is
  fitted (below). Walks at 1024 GPUs end with the two trainings on 640 and 320 GPUs and
  two or three other calls on meshes shaped to them, where the faster plan has each
  training on its own half of the cluster: five calls change at once.

A move of several calls rarely fits with the candidates it first takes: the trainings
moved to the two halves of a node fit only at a pipeline depth between the fastest and
the leanest, and the calls moved onto the whole node leave room for it only at theirs.
So each pair move and each trade of meshes is also tried **fitted**
(:func:`_fitted`): the moved calls start at their fastest candidates on their new
meshes and step down their time/memory Pareto fronts, each step the one that saves the
most memory for the time it adds, until the plan fits; then each moved call in turn
climbs back up its front while the plan still fits and gets faster. That joins plans
that differ in three or four calls at once (the two PPO plans above: both trainings on
the whole node with two scoring calls on its halves, or the reverse), where every
smaller part overflows memory.

It reads only the simulator, so the C++ core and its Python twin polish alike.
"""
from __future__ import annotations

import itertools
from typing import Callable

from planner.search.deadline import Deadline
from planner.search.problem import Problem
from planner.search.simulator import SimResult, energy

Sim = Callable[[list[int]], SimResult]
#: an MFC with at most this many candidates has all of them tried in a one-call move
FULL_SCAN_CANDIDATES = 1000
#: per call and mesh, the fastest and the leanest this many candidates join pair moves
PAIR_OPTIONS = 3
#: a restart on equal parts cuts the cluster into this many parts
PARTS = (1, 2, 4)
#: and tries at most this many ways to put the training calls on them
MAX_PART_MAPS = 16

Mesh = tuple[int, int]          # (first GPU, GPU count)


def _score(prob: Problem, sim: Sim, assign: list[int]) -> float:
    res = sim(assign)
    return energy(prob, res) if res.feasible else float("inf")


def _options(prob: Problem, i: int, mesh: Mesh, n: int = PAIR_OPTIONS) -> list[int]:
    """The ``n`` fastest and the ``n`` leanest candidates of MFC ``i`` on ``mesh``."""
    js = prob.on_mesh[i].get(mesh, [])
    cs = prob.cands[i]
    fast = sorted(js, key=lambda j: (cs[j].time_s, j))[:n]
    lean = sorted(js, key=lambda j: (cs[j].resident_bytes + cs[j].activation_bytes, j)
                  )[:n]
    return list(dict.fromkeys(fast + lean))


def _around(mesh: Mesh) -> list[Mesh]:
    """``mesh`` and the mesh of twice its size that holds it: (8, 4) -> [(8, 4), (8, 8)]."""
    first, n = mesh
    return [mesh, (first - first % (2 * n), 2 * n)]


def _pair_placements(prob: Problem, i: int, k: int, a: list[int]) -> list[tuple[Mesh, Mesh]]:
    """Where a pair move may put MFCs ``i`` and ``k``: both on one mesh, or on its two
    halves, for the meshes they run on and those just above."""
    ci, ck = prob.cands[i][a[i]], prob.cands[k][a[k]]
    meshes = dict.fromkeys(_around((ci.first_gpu, ci.n_gpus)) + _around((ck.first_gpu, ck.n_gpus)))
    out: list[tuple[Mesh, Mesh]] = []
    for first, n in meshes:
        out.append(((first, n), (first, n)))
        if n % 2 == 0:
            lo, hi = (first, n // 2), (first + n // 2, n // 2)
            out += [(lo, hi), (hi, lo)]
    return out


class _Fronts:
    """Per (MFC, mesh), the time/memory Pareto front of its candidates there, fastest
    first (each next one needs less memory per GPU), computed once per polish."""

    def __init__(self, prob: Problem):
        self.prob = prob
        self.memo: dict[tuple[int, Mesh], tuple[list[int], list[float]]] = {}

    def __call__(self, i: int, mesh: Mesh) -> tuple[list[int], list[float]]:
        key = (i, mesh)
        if key not in self.memo:
            cs = self.prob.cands[i]
            js = sorted(self.prob.on_mesh[i].get(mesh, []),
                        key=lambda j: (cs[j].time_s, cs[j].resident_bytes + cs[j].activation_bytes,
                                       j))
            front: list[int] = []
            mem: list[float] = []
            for j in js:
                m = cs[j].resident_bytes + cs[j].activation_bytes
                if not mem or m < mem[-1]:
                    front.append(j)
                    mem.append(m)
            self.memo[key] = front, mem
        return self.memo[key]


def _fitted(prob: Problem, sim: Sim, fronts: _Fronts, a: list[int],
            moved: dict[int, Mesh]) -> tuple[list[int], float]:
    """MFCs ``moved`` onto their meshes, the rest of ``a`` kept. Each moved call starts at
    the fastest point of its front (:class:`_Fronts`); while the plan does not fit, the
    call whose next point saves the most memory per GPU for the time it adds steps down
    to it. Once it fits, each moved call in turn climbs to the fastest point of its front
    that still fits and gains, until none does. (plan, energy); (a, inf) where even the
    leanest points do not fit."""
    fr = {i: fronts(i, m) for i, m in moved.items()}
    if any(not f[0] for f in fr.values()):
        return a, float("inf")
    pos = dict.fromkeys(fr, 0)
    b = list(a)
    for i, (front, _mem) in fr.items():
        b[i] = front[0]
    e = _score(prob, sim, b)
    while e == float("inf"):
        def gain(i: int) -> float:
            front, mem = fr[i]
            k = pos[i]
            dt = prob.cands[i][front[k + 1]].time_s - prob.cands[i][front[k]].time_s
            return (mem[k] - mem[k + 1]) / max(dt, 1e-9)
        down = [i for i in fr if pos[i] + 1 < len(fr[i][0])]
        if not down:
            return a, e
        i = max(down, key=lambda x: (gain(x), -x))
        pos[i] += 1
        b[i] = fr[i][0][pos[i]]
        e = _score(prob, sim, b)
    climbed = True
    while climbed:
        climbed = False
        for i, (front, _mem) in fr.items():
            for k in range(pos[i]):
                c = list(b)
                c[i] = front[k]
                ec = _score(prob, sim, c)
                if ec < e:
                    b, e, pos[i], climbed = c, ec, k, True
                    break
    return b, e


def _best_single(prob: Problem, sim: Sim, a: list[int], e: float
                 ) -> tuple[list[int], float]:
    best, best_e = a, e
    for i in range(len(a)):
        js = (range(len(prob.cands[i])) if len(prob.cands[i]) <= FULL_SCAN_CANDIDATES
              else prob.same_mesh[i][a[i]])
        for j in js:
            if j == a[i]:
                continue
            b = list(a)
            b[i] = j
            eb = _score(prob, sim, b)
            if eb < best_e:
                best, best_e = b, eb
    return best, best_e


def _best_pair(prob: Problem, sim: Sim, fronts: _Fronts, a: list[int], e: float
               ) -> tuple[list[int], float]:
    best, best_e = a, e
    for i, k in itertools.combinations(range(len(a)), 2):
        for mi, mk in _pair_placements(prob, i, k, a):
            b, eb = _fitted(prob, sim, fronts, a, {i: mi, k: mk})
            if eb < best_e:
                best, best_e = b, eb
            for ji, jk in itertools.product(_options(prob, i, mi), _options(prob, k, mk)):
                if (ji, jk) == (a[i], a[k]):
                    continue
                b = list(a)
                b[i], b[k] = ji, jk
                eb = _score(prob, sim, b)
                if eb < best_e:
                    best, best_e = b, eb
    return best, best_e


def _mesh(prob: Problem, i: int, j: int) -> Mesh:
    c = prob.cands[i][j]
    return c.first_gpu, c.n_gpus


def _best_exchange(prob: Problem, sim: Sim, fronts: _Fronts, a: list[int], e: float
                   ) -> tuple[list[int], float]:
    """Two pairs of MFCs trade their meshes (either way round within each pair), each
    call taking its fastest or its leanest candidate on its new mesh."""
    best, best_e = a, e
    pairs = list(itertools.combinations(range(len(a)), 2))
    for (i, k), (p, q) in itertools.combinations(pairs, 2):
        if len({i, k, p, q}) < 4:
            continue
        here, there = (_mesh(prob, i, a[i]), _mesh(prob, k, a[k])), \
            (_mesh(prob, p, a[p]), _mesh(prob, q, a[q]))
        if sorted(here) == sorted(there):
            continue
        for (mi, mk), (mp, mq) in itertools.product((there, there[::-1]), (here, here[::-1])):
            b, eb = _fitted(prob, sim, fronts, a, {i: mi, k: mk, p: mp, q: mq})
            if eb < best_e:
                best, best_e = b, eb
            opts = [_options(prob, x, m, 1) for x, m in ((i, mi), (k, mk), (p, mp), (q, mq))]
            for js in itertools.product(*opts):
                b = list(a)
                b[i], b[k], b[p], b[q] = js
                eb = _score(prob, sim, b)
                if eb < best_e:
                    best, best_e = b, eb
    return best, best_e


def _part_moves(prob: Problem, a: list[int]) -> list[dict[int, Mesh]]:
    """The restarts of :func:`_best_parts`: per cut of the cluster into ``k`` equal parts
    and way to put the training calls on them, the other calls kept where they run, or
    all on the whole cluster, or each with its model's training (the rest kept)."""
    n = prob.cluster.n_gpus
    train = [i for i in range(len(a)) if prob.mfc_is_train[i]]
    rest = [i for i in range(len(a)) if not prob.mfc_is_train[i]]
    whole: Mesh = (0, n)
    out: list[dict[int, Mesh]] = []
    for k in PARTS:
        if n % k or not train:
            continue
        parts = [(p * n // k, n // k) for p in range(k)]
        maps = list(itertools.product(parts, repeat=len(train)))[:MAX_PART_MAPS]
        for where in maps:
            on = dict(zip(train, where))
            with_model = {j: on[prob.model_train_mfc[prob.mfc_model[j]]] for j in rest
                          if prob.model_train_mfc[prob.mfc_model[j]] in on}
            for others in ({}, dict.fromkeys(rest, whole), with_model):
                move = {**on, **others}
                if move not in out:
                    out.append(move)
    return out


def _best_parts(prob: Problem, sim: Sim, fronts: _Fronts, a: list[int], e: float
                ) -> tuple[list[int], float]:
    """The best of :func:`_part_moves`, each fitted (:func:`_fitted`)."""
    best, best_e = a, e
    for move in _part_moves(prob, a):
        move = {i: m for i, m in move.items() if _mesh(prob, i, a[i]) != m} or move
        b, eb = _fitted(prob, sim, fronts, a, move)
        if eb < best_e:
            best, best_e = b, eb
    return best, best_e


def polish(prob: Problem, sim: Sim, assign: list[int], deadline: Deadline | None = None
           ) -> tuple[list[int], float]:
    """The plan reached from ``assign`` by best-improvement moves (see the module), and
    its energy (inf where it does not fit). Deterministic; stops early at the deadline."""
    a, e = list(assign), _score(prob, sim, assign)
    fronts = _Fronts(prob)
    while deadline is None or not deadline.passed():
        b, eb = _best_single(prob, sim, a, e)
        if eb >= e and (deadline is None or not deadline.passed()):
            b, eb = _best_pair(prob, sim, fronts, a, e)
        if eb >= e and (deadline is None or not deadline.passed()):
            b, eb = _best_exchange(prob, sim, fronts, a, e)
        if eb >= e and (deadline is None or not deadline.passed()):
            b, eb = _best_parts(prob, sim, fronts, a, e)
        if eb >= e:
            break
        a, e = b, eb
    return a, e
