"""Hand-written plans of the kind people run today, built in the search's own
candidate space so they are priced by the same simulator and seed the search.

* ``megatron``: symmetric. Every MFC runs on all GPUs, one layout per model chosen
  as a Megatron user would (TP up to its largest before PP; the heaviest model raised
  until the plan fits, then :data:`TUNING_STEPS` more, keeping the fastest), so
  nothing is ever reallocated.
* ``deepspeed-chat``: all MFCs on all GPUs; training is data-parallel (ZeRO-style,
  smallest TP that fits), actor generation switches to intra-node TP (the "hybrid
  engine"), paying a reallocation each iteration.
* ``openrlhf``: disaggregated. Generation, actor training, critic, reference and
  reward each get their own GPUs (or, in the colocated variant, reference with the
  actor and reward with the critic); the best power-of-two split is chosen, each MFC
  with its fastest layout on its GPUs.

Their rules, step by step: docs/heuristics.md.

Each builder returns an assignment (candidate index per MFC) or None when the
heuristic has no plan that fits in memory. ``sim`` prices an assignment (the search
passes the C++ core's simulator, :class:`~planner.search.core_bridge.CoreSimulator`;
by default :func:`~planner.search.simulator.simulate`, its Python twin).
"""
from __future__ import annotations

import bisect
import itertools
from typing import Callable

from planner.search.deadline import Deadline
from planner.search.problem import Problem
from planner.search.simulator import ReallocCache, SimResult, energy, simulate

Assignment = list[int]
#: prices an assignment (same results as planner.search.simulator.simulate)
Sim = Callable[[Assignment], SimResult]


def python_sim(prob: Problem) -> Sim:
    """The Python twin, with one reallocation cache for all its calls."""
    cache = ReallocCache(prob)
    return lambda assign: simulate(prob, assign, cache)


def _on_mesh(prob: Problem, i: int, first: int, n: int) -> list[int]:
    return prob.on_mesh[i].get((first, n), [])


def _mp_order(prob: Problem, i: int, js: list[int]) -> list[tuple[int, int]]:
    """Distinct (tp, pp) of candidates."""
    return sorted({(prob.cands[i][j].tp, prob.cands[i][j].pp) for j in js})


def user_order(layouts: set[tuple[int, int]]) -> list[tuple[int, int]]:
    """(tp, pp) in a Megatron user's order of preference: tensor parallel up to its
    largest before pipeline stages, which then come at the largest TP each has:
    {(1,1), (2,1), (4,1), (1,2), (2,2), (4,2), (4,4)} -> [(1,1), (2,1), (4,1), (4,2), (4,4)]."""
    top = {pp: max(t for t, p in layouts if p == pp) for _, pp in layouts}
    return sorted(((t, p) for t, p in layouts if p == 1 or t == top[p]),
                  key=lambda tp: (tp[1], tp[0]))


def _fit_micro_batches(prob: Problem, choice: list[list[int]], deadline: Deadline | None,
                       sim: Sim) -> Assignment | None:
    """Pick one option per MFC (they differ in micro-batches) that fits in memory.

    Memory is resident state + the largest activation of any call on a GPU, so for
    each activation cap every MFC takes its fastest option under the cap; the best
    feasible cap wins. Exact when every call shares one mesh (times add up there).
    """
    # per MFC: its options by activation, and the fastest among the first k of them
    # (the fastest under a cap is then one bisection: the caps are every activation)
    acts: list[list[float]] = []
    fastest: list[list[int]] = []
    for i, js in enumerate(choice):
        cs = prob.cands[i]
        by_act = sorted(js, key=lambda j: cs[j].activation_bytes)
        acts.append([cs[j].activation_bytes for j in by_act])
        run: list[int] = []
        for j in by_act:
            run.append(j if not run or (cs[j].time_s, j) < (cs[run[-1]].time_s, run[-1])
                       else run[-1])
        fastest.append(run)
    caps = sorted({a for per in acts for a in per})
    best, best_e = None, float("inf")
    seen: set[tuple[int, ...]] = set()
    for cap in reversed(caps):
        if deadline is not None and deadline.passed():
            break
        assign = []
        for i in range(len(choice)):
            k = bisect.bisect_right(acts[i], cap)
            if k == 0:
                break
            assign.append(fastest[i][k - 1])
        if len(assign) < len(choice) or tuple(assign) in seen:
            continue
        seen.add(tuple(assign))
        res = sim(assign)
        if res.feasible and energy(prob, res) < best_e:
            best, best_e = assign, energy(prob, res)
    return best


#: model-parallel steps a user tries past the first that fits, keeping the fastest
TUNING_STEPS = 3


def megatron(prob: Problem, deadline: Deadline | None = None, sim: Sim | None = None
             ) -> Assignment | None:
    sim = sim or python_sim(prob)
    n = prob.n_gpus
    full = [_on_mesh(prob, i, 0, n) for i in range(len(prob.cands))]
    if any(not js for js in full):
        return None
    n_models = len(prob.models)
    mfcs_of = [[i for i in range(len(prob.cands)) if prob.mfc_model[i] == m] for m in range(n_models)]
    # options per model: (tp, pp) that every MFC of the model has on the full mesh
    options = []
    for m in range(n_models):
        common = None
        for i in mfcs_of[m]:
            s = set(_mp_order(prob, i, full[i]))
            common = s if common is None else common & s
        opts = user_order(common or set())
        if not opts:
            return None
        options.append(opts)
    # Like a user tuning by hand: start at the smallest model-parallel sizes, raise
    # the heaviest model's until the plan fits, then a few steps more, keep the best.
    level = [0] * n_models
    best, best_e, extra = None, float("inf"), 0
    while extra <= TUNING_STEPS:
        choice = []
        for i in range(len(prob.cands)):
            tp, pp = options[prob.mfc_model[i]][level[prob.mfc_model[i]]]
            choice.append([j for j in full[i] if (prob.cands[i][j].tp, prob.cands[i][j].pp) == (tp, pp)])
        assign = _fit_micro_batches(prob, choice, None, sim)
        if assign is not None:
            e = energy(prob, sim(assign))
            if e < best_e:
                best, best_e = assign, e
            extra += 1
        bumpable = [m for m in range(n_models) if level[m] + 1 < len(options[m])]
        if not bumpable:
            break
        heaviest = max(bumpable, key=lambda m: max(
            prob.cands[i][choice[i][0]].resident_bytes for i in mfcs_of[m]))
        level[heaviest] += 1
    return best


def deepspeed_chat(prob: Problem, deadline: Deadline | None = None, sim: Sim | None = None
                   ) -> Assignment | None:
    sim = sim or python_sim(prob)
    n, gpn = prob.n_gpus, prob.cluster.gpus_per_node
    choice = []
    for i in range(len(prob.cands)):
        js = [j for j in _on_mesh(prob, i, 0, n) if prob.cands[i][j].pp == 1]
        if not js:
            return None
        kind = prob.graph.mfcs[i].kind
        if kind == "generate":
            tp = max(prob.cands[i][j].tp for j in js if prob.cands[i][j].tp <= gpn)
            choice.append([j for j in js if prob.cands[i][j].tp == tp])
        else:
            choice.append(js)
    # training and scoring: smallest TP at which the whole plan fits
    tps = sorted({prob.cands[i][j].tp for i, js in enumerate(choice) for j in js})
    for tp in tps:
        narrowed = []
        for i, js in enumerate(choice):
            if prob.graph.mfcs[i].kind == "generate":
                narrowed.append(js)
                continue
            at = [j for j in js if prob.cands[i][j].tp == tp]
            narrowed.append(at or js)
        assign = _fit_micro_batches(prob, narrowed, None, sim)
        if assign is not None:
            return assign
    return None


def _pool_keys(prob: Problem, colocate: bool) -> list[str]:
    roles = {m.role for m in prob.graph.mfcs}
    keys = []
    for m in prob.graph.mfcs:
        if m.kind == "generate":
            keys.append("gen")
        elif colocate and m.role == "ref":
            keys.append("actor")
        elif colocate and m.role == "reward" and "critic" in roles:
            keys.append("critic")
        else:
            keys.append(m.role)
    return keys


def _pow2_splits(n: int, parts: int, gpn: int) -> list[tuple[int, ...]]:
    sizes = [s for s in (2 ** k for k in range(0, 12))
             if s <= n and (s < gpn and gpn % s == 0 or s % gpn == 0)]
    return [c for c in itertools.product(sizes, repeat=parts) if sum(c) == n]


def openrlhf(prob: Problem, deadline: Deadline | None = None, sim: Sim | None = None
             ) -> Assignment | None:
    sim = sim or python_sim(prob)
    best, best_e = None, float("inf")
    for colocate in (False, True):
        keys = _pool_keys(prob, colocate)
        pools = list(dict.fromkeys(keys))
        for split in _pow2_splits(prob.n_gpus, len(pools), prob.cluster.gpus_per_node):
            if deadline is not None and deadline.passed():
                return best
            # place pools largest first: power-of-two blocks stay aligned
            order = sorted(range(len(pools)), key=lambda p: -split[p])
            first, where = 0, {}
            for p in order:
                where[pools[p]] = (first, split[p])
                first += split[p]
            choice = [_on_mesh(prob, i, *where[keys[i]]) for i in range(len(prob.cands))]
            if any(not js for js in choice):
                continue
            assign = _fit_micro_batches(prob, choice, deadline, sim)
            if assign is None:
                continue
            e = energy(prob, sim(assign))
            if e < best_e:
                best, best_e = assign, e
    return best


#: the heuristics that run every MFC on all GPUs
ALL_GPUS = ("megatron", "deepspeed-chat")


def not_applicable(name: str, prob: Problem) -> str | None:
    """Why heuristic ``name`` cannot express a plan of ``prob`` at all (None: it can,
    and when it has no plan, nothing it builds fits in memory): the all-GPU heuristics
    need every MFC on the whole cluster, which an asynchronous graph's generation made
    ahead (on GPUs of its own) and the calls beside it cannot have."""
    if name not in ALL_GPUS:
        return None
    lacking = [m.name for i, m in enumerate(prob.graph.mfcs)
               if not _on_mesh(prob, i, 0, prob.n_gpus)]
    if not lacking:
        return None
    if prob.graph.ahead_steps > 0:
        return ("it runs every call on all GPUs; an asynchronous plan generates ahead on "
                "GPUs of its own")
    return f"it runs every call on all GPUs; {lacking[0]} has no layout on all {prob.n_gpus}"


#: name -> builder(problem, deadline, sim) (a builder past the deadline returns what it has)
HEURISTICS: dict[str, Callable[..., Assignment | None]] = {
    "megatron": megatron,
    "deepspeed-chat": deepspeed_chat,
    "openrlhf": openrlhf,
}
