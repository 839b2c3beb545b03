"""search(): graph + models + cluster + cost model -> ExecutionPlan.

Pure: no I/O, no environment variables. Steps:
1. price every candidate allocation of every MFC (:mod:`planner.search.problem`);
2. build the hand-written heuristic plans (:mod:`planner.search.heuristics`) in that space;
3. search from them: exact branch and bound when the space is small, else
   simulated annealing in the C++ core, anytime, in two phases. First one walk from
   each seed and from ``anneal_random_starts`` random plans, the walks taking turns:
   each walk's chains double in length, each from the best it has found, until
   ``anneal_patience`` chains in a row improve it by less than 0.5 % (converged) or it
   falls 2 % behind the leading walk. Then fresh walks from the best plan so far, each
   with new random numbers, until ``anneal_restarts`` of them in a row find nothing
   better. Then a deterministic local search (:func:`~planner.search.polish.polish`:
   one call's layout, two calls' meshes together, two pairs trading meshes) climbs
   from the best. The steps (``anneal_steps``) and the time bound all of it;
4. the best plan found is never worse than any heuristic (they are its seeds).
``time_limit_s`` bounds all of it on the wall clock (:class:`~planner.search.deadline.Deadline`):
a phase that runs out of time stops with what it has (the search keeps the best seed),
and set-up that cannot finish in time is a :class:`PlanError` naming the setting.
If nothing fits in memory, :class:`InfeasibleError` says what does not fit and the
smallest cluster (more nodes of the same kind) that would.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

from planner.cost.cost_config import CostModelConfig
from planner.cost.cost_model import CostModel
from planner.cost.profile import ProfileTable
from planner.errors import InfeasibleError, PlanError
from planner.graph.dataflow import DataflowGraph
from planner.plan import ExecutionPlan, HeuristicResult, SearchInfo
from planner.search.anneal import AnnealSettings, SplitMix64
from planner.search.core_bridge import CoreSimulator
from planner.search.deadline import Deadline
from planner.search.exact import branch_and_bound
from planner.search.gc_pause import gc_paused
from planner.search.heuristics import HEURISTICS, Sim, not_applicable
from planner.search.mesh_blocks import first_min
from planner.search.plan_build import build_plan, describe_candidate
from planner.search.polish import polish
from planner.search.problem import Candidate, Problem, RoleModel, async_splits, build_problem
from planner.search.simulator import energy, simulate
from planner.search_settings import SearchSettings as SearchSettings  # callers import it here
from planner.specs.cluster import MAX_NODES, ClusterSpec


def _lean_key(c: Candidate) -> tuple[float, int, float]:
    return (c.resident_bytes + c.activation_bytes, -c.n_gpus, c.time_s)


def _min_memory_start(prob: Problem) -> list[int]:
    """Each MFC on its leanest candidate (most GPUs, least memory; the first of equals),
    read per mesh size where the problem keeps its candidates as priced."""
    if prob.mesh_blocks:
        return [first_min(blocks, _lean_key) for blocks in prob.mesh_blocks]
    return [min(range(len(cs)), key=lambda j: _lean_key(cs[j])) for cs in prob.cands]


def _heuristics(prob: Problem, deadline: Deadline | None = None, sim: Sim | None = None
                ) -> tuple[dict[str, list[int] | None], set[str]]:
    """Each heuristic's plan (None: it has none that fits), and the names of those not
    built because the deadline passed first."""
    out: dict[str, list[int] | None] = {}
    skipped: set[str] = set()
    for name, fn in HEURISTICS.items():
        if deadline is not None and deadline.passed():
            out[name] = None
            skipped.add(name)
        else:
            out[name] = fn(prob, deadline, sim)
    return out, skipped


#: a chain that improves its walk's best by less than this share has not improved it:
#: a doubled chain gains less than the last one did, so the walk has converged
CONVERGED_GAIN = 5e-3
#: after a round of chains, a walk whose best is this share above the best walk's is
#: given up (its seed led elsewhere): the time goes to the walks that lead
BEHIND_SHARE = 2e-2


@dataclass
class _Walk:
    """One seed's annealing walk: its best plan so far, the next chain's length and
    how many chains in a row gained less than :data:`CONVERGED_GAIN`."""

    best: list[int]
    energy: float
    next_steps: int
    misses: int = 0


def _walks(sim: CoreSimulator, walks: list[_Walk], s: SearchSettings, deadline: Deadline,
           stream: int, spent: int) -> int:
    """Run ``walks`` in turns (each chain from its walk's best, twice as long as the
    last) until every walk has converged or fallen behind, or the steps (``spent`` of
    them gone already) or the time run out. ``stream`` keeps the random numbers of
    separate calls apart. Returns the steps run."""
    steps, chain = 0, 0
    while spent + steps < s.anneal_steps and any(w.misses < s.anneal_patience for w in walks):
        for k, w in enumerate(walks):
            if w.misses >= s.anneal_patience:
                continue
            left = deadline.left_s()
            if left <= 0 or spent + steps >= s.anneal_steps:
                break
            n = min(w.next_steps, s.anneal_steps - spent - steps)
            seed = s.seed + 1_000_003 * stream + 1000 * k + chain
            r = sim.anneal(w.best, AnnealSettings(n_steps=n, seed=seed), time_limit_s=left)
            steps += r.steps
            if r.feasible and r.energy < w.energy * (1 - CONVERGED_GAIN):
                w.best, w.energy, w.misses = r.assign, r.energy, 0
            else:
                if r.feasible and r.energy < w.energy:
                    w.best, w.energy = r.assign, r.energy
                w.misses += 1
            w.next_steps *= 2
        chain += 1
        lead = min(w.energy for w in walks)
        for w in walks:
            if w.energy > lead * (1 + BEHIND_SHARE):
                w.misses = s.anneal_patience
        if deadline.left_s() <= 0:
            break
    return steps


def random_starts(prob: Problem, n: int, seed: int) -> list[list[int]]:
    """``n`` plans with every MFC on a candidate drawn at random (SplitMix64 of ``seed``)."""
    rng = SplitMix64(seed)
    return [[int(rng.next() % len(cs)) for cs in prob.cands] for _ in range(n)]


def _anneal(sim: CoreSimulator, seeds: list[list[int]], s: SearchSettings,
            deadline: Deadline) -> tuple[list[int] | None, float, int, bool]:
    """Anytime annealing in two phases (the module's step 3): walks from the seeds and
    from random plans, then walks from the best plan so far until
    ``anneal_restarts`` in a row find nothing better. (best, its energy, steps, every
    walk converged)."""
    prob = sim.prob

    def walk(a: list[int]) -> _Walk:
        start = sim(a)
        return _Walk(list(a), energy(prob, start) if start.feasible else math.inf,
                     s.anneal_start_steps)

    walks = [walk(a) for a in seeds + random_starts(prob, s.anneal_random_starts, s.seed)]
    steps = _walks(sim, walks, s, deadline, 0, 0)
    done = all(w.misses >= s.anneal_patience for w in walks)
    best = min(walks, key=lambda w: w.energy)
    fails, stream = 0, 1
    while (done and fails < s.anneal_restarts and best.energy < math.inf
           and steps < s.anneal_steps and deadline.left_s() > 0):
        w = walk(best.best)
        steps += _walks(sim, [w], s, deadline, stream, steps)
        done = w.misses >= s.anneal_patience
        stream += 1
        if w.energy < best.energy:
            best, fails = w, 0
        else:
            fails += 1
    return (best.best if best.energy < math.inf else None), best.energy, steps, done


def search(name: str, graph: DataflowGraph, models: dict[str, RoleModel], cluster: ClusterSpec,
           cost_config: CostModelConfig | None = None, profile: ProfileTable | None = None,
           settings: SearchSettings | None = None) -> ExecutionPlan:
    """The best plan of ``graph``. An asynchronous graph is searched once per way of
    dividing the cluster between generation and training (:func:`~planner.search.problem.
    async_splits`, each with an equal share of the time limit); the fastest wins."""
    if graph.ahead_steps == 0:
        return _search(name, graph, models, cluster, cost_config, profile, settings)
    s = settings or SearchSettings()
    splits = async_splits(cluster)
    if not splits:
        raise InfeasibleError(f"an asynchronous plan generates and trains on separate GPUs; "
                              f"{cluster.describe()} has one", field="cluster")
    share = s.model_copy(update={"time_limit_s": s.time_limit_s / len(splits)})
    best, why = None, ""
    for split in splits:
        try:
            plan = _search(name, graph, models, cluster, cost_config, profile, share, split)
        except InfeasibleError as e:
            why = e.message
            continue
        if best is None or plan.iteration_time_s < best.iteration_time_s:
            best = plan
    if best is None:
        raise InfeasibleError(f"no asynchronous plan fits: {why}", field="cluster")
    return best


def search_split(name: str, graph: DataflowGraph, models: dict[str, RoleModel],
                 cluster: ClusterSpec, split: int, cost_config: CostModelConfig | None = None,
                 profile: ProfileTable | None = None,
                 settings: SearchSettings | None = None) -> ExecutionPlan:
    """The best plan of an asynchronous ``graph`` with its rollout generation on the GPUs
    below ``split`` and the rest of each step on the others (one of
    :func:`~planner.search.problem.async_splits`); :class:`InfeasibleError` where none
    fits. The streaming search prices each split's sides from it."""
    return _search(name, graph, models, cluster, cost_config, profile, settings, split)


def _search(name: str, graph: DataflowGraph, models: dict[str, RoleModel], cluster: ClusterSpec,
            cost_config: CostModelConfig | None = None, profile: ProfileTable | None = None,
            settings: SearchSettings | None = None, split: int | None = None) -> ExecutionPlan:
    with gc_paused():       # hundreds of thousands of candidates, no cycles among them
        return _search_gc_off(name, graph, models, cluster, cost_config, profile, settings, split)


def _search_gc_off(name: str, graph: DataflowGraph, models: dict[str, RoleModel],
                   cluster: ClusterSpec, cost_config: CostModelConfig | None,
                   profile: ProfileTable | None, settings: SearchSettings | None,
                   split: int | None) -> ExecutionPlan:
    s = settings or SearchSettings()
    cost_config = cost_config or CostModelConfig()
    t0 = time.perf_counter()
    # the phases stop at 90 % of the limit: building the plan from the result takes the rest
    deadline = Deadline(t0 + 0.9 * s.time_limit_s, s.time_limit_s)
    cost = CostModel(cluster, cost_config, profile)
    try:
        prob = build_problem(graph, models, cost, n_iters=s.n_iters, deadline=deadline,
                             split=split)
    except PlanError as e:
        if e.field == "plan.time_limit_s":
            raise
        if split is not None:
            raise InfeasibleError(f"{e.message} (generation on GPUs below {split})",
                                  field="cluster") from None
        raise InfeasibleError(f"{e.message}. "
                              f"{_suggest(graph, models, cluster, cost_config, profile, deadline)}",
                              field="cluster") from None
    sim = CoreSimulator(prob)        # the C++ twin, one reallocation cache for all calls
    heur, skipped = _heuristics(prob, deadline, sim)
    heur_e = {n: (energy(prob, sim(a)) if a is not None else None) for n, a in heur.items()}
    seeds = sorted((a for a in heur.values() if a is not None),
                   key=lambda a: energy(prob, sim(a)))
    unique: list[list[int]] = []
    for a in seeds:
        if a not in unique:
            unique.append(a)
    unique.append(_min_memory_start(prob))
    method = s.method
    if method == "auto":
        method = "exact" if prob.space_size() <= s.exact_max_space else "anneal"
    complete, converged = True, False
    if method == "exact":
        incumbent = unique[0] if sim(unique[0]).feasible else None
        r = branch_and_bound(prob, incumbent, s.exact_max_nodes, deadline)
        best, steps, complete = r.assign, r.nodes, r.complete
    else:
        best, _e, steps, converged = _anneal(sim, unique, s, deadline)
        if best is not None:
            best = polish(prob, sim, best, deadline)[0]
        complete = False
    if best is None:        # out of time before the search found one: the best seed that fits
        fits = [a for a in unique if sim(a).feasible]
        best = min(fits, key=lambda a: energy(prob, sim(a))) if fits else None
    if best is None:
        if split is not None:
            raise InfeasibleError(f"{_what_does_not_fit(prob)} (generation on GPUs below "
                                  f"{split})", field="cluster")
        raise InfeasibleError(f"{_what_does_not_fit(prob)}. "
                              f"{_suggest(graph, models, cluster, cost_config, profile, deadline)}",
                              field="cluster")
    # never worse than a heuristic (they seed the search; this makes it explicit)
    for a in seeds:
        if energy(prob, sim(a)) < energy(prob, sim(best)):
            best = a
    elapsed = time.perf_counter() - t0
    info = SearchInfo(method=method, seed=s.seed, search_time_s=elapsed,
                      space_size=float(prob.space_size()),
                      candidates={m.name: len(c) for m, c in zip(graph.mfcs, prob.cands)},
                      steps=steps, complete=complete, converged=converged)
    heuristics = tuple(
        HeuristicResult(name=n, iteration_time_s=heur_e[n], evaluated=n not in skipped,
                        allocations=({m.name: describe_candidate(prob, i, a[i])
                                      for i, m in enumerate(graph.mfcs)} if a else {}),
                        not_applicable=None if a else not_applicable(n, prob))
        for n, a in heur.items())
    return build_plan(name, prob, best, cost_config, info, heuristics)


def _what_does_not_fit(prob: Problem) -> str:
    start = _min_memory_start(prob)
    res = simulate(prob, start)
    worst = max(range(prob.n_gpus), key=lambda g: res.peak_bytes[g])
    users = [prob.graph.mfcs[i].name for i in range(len(start))
             if prob.cands[i][start[i]].first_gpu <= worst
             < prob.cands[i][start[i]].first_gpu + prob.cands[i][start[i]].n_gpus]
    gib = 2 ** 30
    return (f"no plan fits in {prob.mem_limit_bytes / gib:.1f} GiB per GPU on "
            f"{prob.cluster.describe()}: even with every model spread as thin as it goes, "
            f"GPU {worst} needs {res.peak_bytes[worst] / gib:.1f} GiB for "
            f"{', '.join(users)}")


#: The annealing run that looks for any plan that fits when sizing a cluster.
FITS_ANNEAL_STEPS, FITS_ANNEAL_S = 20_000, 5.0


def _fits_on(graph: DataflowGraph, models: dict[str, RoleModel], cluster: ClusterSpec,
             cost_config: CostModelConfig, profile: ProfileTable | None,
             deadline: Deadline | None) -> bool:
    try:
        prob = build_problem(graph, models, CostModel(cluster, cost_config, profile), n_iters=1,
                             deadline=deadline)
    except PlanError as e:
        if e.field == "plan.time_limit_s":
            raise
        return False
    start = _min_memory_start(prob)
    sim = CoreSimulator(prob)
    if sim(start).feasible or any(
            a is not None for a in _heuristics(prob, deadline, sim)[0].values()):
        return True
    # the leanest candidate of each MFC need not make the leanest plan (e.g. an
    # offloaded optimizer on part of the GPUs): a short annealing run looks further
    if deadline is None:
        deadline = Deadline(time.perf_counter() + FITS_ANNEAL_S, FITS_ANNEAL_S)
    best, _e, _n, _done = _anneal(sim, [start], SearchSettings(anneal_steps=FITS_ANNEAL_STEPS),
                                  deadline)
    return best is not None


_SMALLER = ("use smaller models (models.*) or a smaller batch (algorithm.prompts_per_step, "
            "samples_per_prompt, prompt_len, gen_len)")


def _suggest(graph: DataflowGraph, models: dict[str, RoleModel], cluster: ClusterSpec,
             cost_config: CostModelConfig, profile: ProfileTable | None,
             deadline: Deadline | None = None) -> str:
    """The smallest cluster of the same node kind on which a plan fits: double the
    node count until one fits, then bisect between the last two counts (within
    :data:`~planner.specs.cluster.MAX_NODES` nodes and the deadline)."""
    def fits(n: int) -> bool:
        return _fits_on(graph, models, cluster.model_copy(update={"n_nodes": n}),
                        cost_config, profile, deadline)

    try:
        lo, hi = cluster.n_nodes, min(cluster.n_nodes * 2, MAX_NODES)
        while not (hi > lo and fits(hi)):
            if hi >= MAX_NODES:
                return f"No cluster of up to {MAX_NODES} such nodes fits it; {_SMALLER}"
            lo, hi = hi, min(hi * 2, MAX_NODES)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    except PlanError:
        return f"(No bigger cluster was tried within plan.time_limit_s); or {_SMALLER}"
    return (f"The smallest cluster that fits: {hi} nodes x {cluster.gpus_per_node} "
            f"{cluster.device.name} ({hi * cluster.gpus_per_node} GPUs); or {_SMALLER}")
