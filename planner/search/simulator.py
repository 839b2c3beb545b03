"""The simulator: run a few iterations of the dataflow graph under one assignment
(a candidate index per MFC) and return the iteration time and per-GPU peak memory.

Rules (list scheduling in graph order, iteration by iteration, as the runtime's
program runs: :mod:`realign.run.program`):
* an MFC starts when the MFCs it reads from (same iteration) have finished, when
  its model's previous training call has finished (new parameters), and when every
  GPU of its mesh is free: MFCs on disjoint meshes overlap, MFCs that share a GPU
  serialise;
* a call of a trained model whose placement differs from its training placement is
  preceded by a parameter reallocation, which occupies the GPUs of both placements;
* then each record the call reads that some of its GPUs lack is sent to them by its
  holders (a ``Send``: it occupies the senders and the receivers, which then hold it
  too); records from the dataset are everywhere;
* asynchronous graphs (:attr:`~planner.graph.dataflow.DataflowGraph.ahead_steps`): a rollout
  generation makes the *next* step's samples. Each step first reallocates the
  weights it generates with (the policy the previous step trained), then runs the
  other MFCs in graph order, reading the rollout the previous step generated from the
  generating mesh (steady state: it is there from the first simulated step; it is
  sent at the step's start, after those reallocations, to every mesh that reads it,
  so the generating mesh is free again at once), then the generation; on a disjoint
  mesh it overlaps the training side, so a step costs the slower side plus the
  weight transfer and the rollout's sends. The slower side *of each step*: with a
  length distribution both sides' times vary (:attr:`~planner.search.problem.Candidate.
  time_sd_s`), and the step ends at the expected maximum of the two sides' ends
  (:func:`planner.cost.step_spread.expected_max`), not at the later expected end. Its
  weight copy lives from the step's start to its end, so it counts as resident memory;
* iterations do not overlap: the controller starts step k+1 once every worker has
  finished step k, so each iteration starts when the previous one has ended on every
  GPU, plus the step's host overhead (:attr:`~planner.search.problem.Problem.step_overhead_s`:
  the controller's round trip, the workers' batches); iteration time = makespan of
  ``n_iters`` iterations / ``n_iters``.

Memory per GPU = resident state (trained models' weights, grads and optimizer state
on their training mesh; frozen models' weights on each placement they use; a LoRA
model's frozen base on each placement it is reallocated to, where it stays, and on each
placement of a call with its adapters off (the reference scored as the actor's base:
:mod:`planner.graph.shared_base`), once per placement whichever calls use it, nothing
extra on the training placement, whose resident state holds it) + the
largest transient need of any call on that GPU (activations, KV cache, and the
temporary weight copy of a reallocated call). Calls sharing a GPU never run at the
same time, so their transients never add up.

This module is the Python twin of the C++ core's simulator (``csrc/simulate.cpp``,
``csrc/sim_memory.cpp``): both must return identical numbers; a test compares them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from planner.cost.realloc_cost import Place, realloc_time
from planner.cost.step_spread import expected_max
from planner.search.problem import Problem

#: Energy penalty per unit of relative memory overflow (infeasible states stay
#: reachable for the annealer, but cost more the more they overflow).
OVERFLOW_PENALTY = 10.0


@dataclass(frozen=True)
class Event:
    """One bar of the timeline."""

    name: str            #: MFC name, or "realloc <model>: <from> -> <to>"
    kind: str            #: generate | inference | train | realloc
    iteration: int
    start_s: float
    end_s: float
    first_gpu: int
    n_gpus: int
    gpus: tuple[int, ...] = ()   #: all GPUs occupied (realloc: both placements)


@dataclass
class SimResult:
    iter_time_s: float
    makespan_s: float
    overflow_bytes: float
    peak_bytes: list[float]
    events: list[Event] = field(default_factory=list)
    realloc: dict[tuple[int, int], tuple[float, int]] = field(default_factory=dict)

    @property
    def feasible(self) -> bool:
        return self.overflow_bytes <= 0.0


class ReallocCache:
    """Memoised reallocation times keyed by (model, source placement, destination
    placement): candidates that differ only in micro-batches or offload share one."""

    def __init__(self, prob: Problem):
        self.prob = prob
        self.table: dict[tuple[int, Place, Place], tuple[float, int]] = {}

    def get(self, model: int, train_mfc: int, src: int, mfc: int, dst: int) -> tuple[float, int]:
        p = self.prob
        a, b = p.cands[train_mfc][src].place, p.cands[mfc][dst].place
        key = (model, a, b)
        hit = self.table.get(key)
        if hit is None:
            hit = realloc_time(p.realloc_models[model], a, b, p.links)
            self.table[key] = hit
        return hit


def needs_realloc(prob: Problem, assign: list[int], i: int, upto: int | None = None) -> bool:
    """Whether MFC i holds its model's parameters in another shard placement than the
    model's training call (:func:`planner.specs.layout.shard_placement`; False while the
    training MFC is not yet assigned, i.e. at or beyond ``upto``), and reads its trained
    tensors (a call with its adapters off reads the frozen base only: False)."""
    if prob.mfc_base and prob.mfc_base[i]:
        return False
    return off_training_placement(prob, assign, i, upto)


def off_training_placement(prob: Problem, assign: list[int], i: int,
                           upto: int | None = None) -> bool:
    """Whether MFC i runs on another shard placement than its model's training call
    (False for an untrained model, the training call itself, or while the training
    call is not yet assigned, i.e. at or beyond ``upto``)."""
    model = prob.mfc_model[i]
    t = prob.model_train_mfc[model]
    if t < 0 or t == i or (upto is not None and t >= upto):
        return False
    return prob.cands[t][assign[t]].shards != prob.cands[i][assign[i]].shards


def memory(prob: Problem, assign: list[int], upto: int | None = None) -> tuple[list[float], float]:
    """(peak bytes per GPU, worst overflow over the limit in bytes, 0 if it fits).

    With ``upto``, only MFCs ``0 .. upto-1`` count (a lower bound for branch and bound).
    """
    n = prob.n_gpus
    resident = [0.0] * n
    transient = [0.0] * n
    seen: set[tuple[int, int, int, int, int, int]] = set()
    for i in range(len(prob.cands) if upto is None else upto):
        c = prob.cands[i][assign[i]]
        model = prob.mfc_model[i]
        trained = prob.model_train_mfc[model] >= 0
        add_res = 0.0
        if prob.mfc_is_train[i]:
            add_res = c.resident_bytes
        elif not trained:
            key = (model, c.first_gpu, c.n_gpus, c.tp, c.pp, c.ep)
            if key not in seen:
                seen.add(key)
                add_res = c.resident_bytes
        if prob.mfc_base and prob.mfc_base[i] and off_training_placement(prob, assign, i, upto):
            # the base with its adapters off, away from training: the base stays here
            key = (model, c.first_gpu, c.n_gpus, c.tp, c.pp, c.ep)
            if key not in seen:
                seen.add(key)
                add_res = c.resident_bytes
        tr = c.activation_bytes
        if trained and not prob.mfc_is_train[i] and needs_realloc(prob, assign, i, upto):
            if prob.model_lora and prob.model_lora[model]:
                # LoRA: the frozen base stays on each placement (resident_bytes); only
                # the adapters (weights_bytes) are the reallocated copy
                key = (model, c.first_gpu, c.n_gpus, c.tp, c.pp, c.ep)
                if key not in seen:
                    seen.add(key)
                    add_res += c.resident_bytes
            if prob.ahead[i]:       # its copy is made at the step's start, kept to its end
                add_res += c.weights_bytes
            else:
                tr = tr + c.weights_bytes
        for g in range(c.first_gpu, c.first_gpu + c.n_gpus):
            resident[g] += add_res
            if tr > transient[g]:
                transient[g] = tr
    peak = [resident[g] + transient[g] for g in range(n)]
    over = 0.0
    for g in range(n):
        if peak[g] - prob.mem_limit_bytes > over:
            over = peak[g] - prob.mem_limit_bytes
    return peak, over


def simulate(prob: Problem, assign: list[int], cache: ReallocCache | None = None,
             record: bool = False, upto: int | None = None) -> SimResult:
    """Simulate ``prob.n_iters`` iterations. With ``upto``, only MFCs ``0 .. upto-1``
    are scheduled (constraints involving the others are dropped), which gives a
    lower bound on the full makespan: list scheduling only ever delays tasks when
    more tasks or constraints are added."""
    cache = cache or ReallocCache(prob)
    n_mfc = len(prob.cands) if upto is None else upto
    free = [0.0] * prob.n_gpus
    prev_finish = [0.0] * n_mfc
    events: list[Event] = []
    reallocs: dict[tuple[int, int], tuple[float, int]] = {}
    makespan = 0.0
    gpn = prob.cluster.gpus_per_node
    everyone = tuple(range(prob.n_gpus))
    ahead = [i for i in range(n_mfc) if prob.ahead[i]]
    order = [i for i in range(n_mfc) if not prob.ahead[i]] + ahead

    def realloc(it: int, i: int) -> float:
        """Schedule the reallocation before MFC i on both placements; its end."""
        c = prob.cands[i][assign[i]]
        model = prob.mfc_model[i]
        t = prob.model_train_mfc[model]
        src = prob.cands[t][assign[t]]
        r_time, r_bytes = cache.get(model, t, assign[t], i, assign[i])
        r_start = prev_finish[t] if it > 0 else 0.0
        for g in range(src.first_gpu, src.first_gpu + src.n_gpus):
            if free[g] > r_start:
                r_start = free[g]
        for g in range(c.first_gpu, c.first_gpu + c.n_gpus):
            if free[g] > r_start:
                r_start = free[g]
        r_end = r_start + r_time
        for g in range(src.first_gpu, src.first_gpu + src.n_gpus):
            free[g] = r_end
        for g in range(c.first_gpu, c.first_gpu + c.n_gpus):
            free[g] = r_end
        reallocs[(model, i)] = (r_time, r_bytes)
        if record:
            gpus = tuple(sorted(set(range(src.first_gpu, src.first_gpu + src.n_gpus))
                                | set(range(c.first_gpu, c.first_gpu + c.n_gpus))))
            name = f"realloc {prob.models[model].role} -> {prob.graph.mfcs[i].name}"
            events.append(Event(name, "realloc", it, r_start, r_end, c.first_gpu, c.n_gpus,
                                gpus))
        return r_end

    def send(it: int, i: int, key: int, have: tuple[int, ...]) -> float:
        """Send record ``key`` to the GPUs of MFC i's mesh that lack it (occupying them
        and as many holders); its end (0: nothing to send)."""
        c = prob.cands[i][assign[i]]
        lack = [g for g in range(c.first_gpu, c.first_gpu + c.n_gpus) if g not in have]
        if not lack:
            return 0.0
        occ = sorted(set(have[:len(lack)]) | set(lack))
        intra_s, inter_s = prob.key_send_s[key]
        dur = (inter_s if occ[0] // gpn != occ[-1] // gpn else intra_s) / prob.mfc_every[i]
        s_start = 0.0
        for g in occ:
            if free[g] > s_start:
                s_start = free[g]
        s_end = s_start + dur
        for g in occ:
            free[g] = s_end
        if prob.mfc_every[i] == 1:
            holders[key] = tuple(sorted(set(have) | set(lack)))
        if record:
            events.append(Event(f"send {prob.key_names[key]}", "send", it, s_start, s_end,
                                occ[0], len(occ), tuple(occ)))
        return s_end

    holders: dict[int, tuple[int, ...]] = {}
    for it in range(prob.n_iters):
        makespan += prob.step_overhead_s        # between steps: the controller, batches
        for g in range(prob.n_gpus):            # the step barrier
            free[g] = makespan
        finish = [0.0] * n_mfc
        holders.clear()
        ahead_ready: dict[int, float] = {}
        for i in ahead:
            # what the previous step generated ahead is on the generating mesh; the
            # weights it generates with next are reallocated first
            c = prob.cands[i][assign[i]]
            for key in prob.outputs[i]:
                holders[key] = tuple(range(c.first_gpu, c.first_gpu + c.n_gpus))
            if needs_realloc(prob, assign, i, upto):
                ahead_ready[i] = realloc(it, i)
        for i in order:
            # then that rollout goes to every mesh of this step that reads it, so the
            # generating mesh is free for the next one
            if prob.ahead[i] or prob.mfc_every[i] != 1:
                continue
            for key, producer in prob.inputs[i]:
                if producer >= 0 and prob.ahead[producer] and key in holders:
                    send(it, i, key, holders[key])
        for i in order:
            c = prob.cands[i][assign[i]]
            model = prob.mfc_model[i]
            t = prob.model_train_mfc[model]
            ready = ahead_ready.get(i, 0.0)
            for d in prob.deps[i]:
                if finish[d] > ready:
                    ready = finish[d]
            if t >= 0 and t < n_mfc and it > 0 and prev_finish[t] > ready:
                ready = prev_finish[t]
            if t >= 0 and t != i and not prob.ahead[i] and needs_realloc(prob, assign, i, upto):
                r_end = realloc(it, i)
                if r_end > ready:
                    ready = r_end
            mesh = range(c.first_gpu, c.first_gpu + c.n_gpus)
            for key, producer in prob.inputs[i]:
                have = everyone if producer < 0 else holders.get(key)
                if have is None:                 # its producer is not scheduled (upto)
                    continue
                s_end = send(it, i, key, have)
                if s_end > ready:
                    ready = s_end
            start = ready
            for g in range(c.first_gpu, c.first_gpu + c.n_gpus):
                if free[g] > start:
                    start = free[g]
            end = start + c.time_s
            for g in range(c.first_gpu, c.first_gpu + c.n_gpus):
                free[g] = end
            finish[i] = end
            for key in prob.outputs[i]:
                holders[key] = tuple(mesh)
            if end > makespan:
                makespan = end
            if record:
                m = prob.graph.mfcs[i]
                name = f"{m.name} (next step)" if prob.ahead[i] else m.name
                events.append(Event(name, m.kind, it, start, end, c.first_gpu, c.n_gpus,
                                    tuple(range(c.first_gpu, c.first_gpu + c.n_gpus))))
        if ahead and upto is None:
            makespan = max(makespan, _slower_side_end(prob, assign, finish))
        prev_finish = finish
    peak, over = memory(prob, assign, upto)
    return SimResult(makespan / prob.n_iters, makespan, over, peak, events, reallocs)


def _slower_side_end(prob: Problem, assign: list[int], finish: list[float]) -> float:
    """An asynchronous step's expected end: the slower of its two sides *per step*
    (:func:`planner.cost.step_spread.expected_max`): the generation made ahead (independent
    spreads) against the rest (one batch's lengths drive them all: spreads add)."""
    gen_end = train_end = gen_var = train_sd = 0.0
    for i in range(len(finish)):
        sd = prob.cands[i][assign[i]].time_sd_s
        if prob.ahead[i]:
            gen_end = max(gen_end, finish[i])
            gen_var += sd * sd
        else:
            train_end = max(train_end, finish[i])
            train_sd += sd
    return expected_max(gen_end, math.sqrt(gen_var), train_end, train_sd)


def energy(prob: Problem, res: SimResult) -> float:
    """What the search minimises: iteration time, penalised by memory overflow."""
    return res.iter_time_s * (1.0 + OVERFLOW_PENALTY * res.overflow_bytes / prob.mem_limit_bytes)
