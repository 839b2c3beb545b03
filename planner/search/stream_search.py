"""The streaming search (``rollout.mode: streaming``): the split of the cluster between a
generator that decodes continuously and a trainer, each side's layouts, and the
staleness bound, chosen by the predicted steady state of the stream.

For every split of :func:`~planner.search.problem.async_splits` the asynchronous search
of that split (:func:`~planner.search.search.search_split`: generation on the GPUs
below it, scoring and training on the rest) places and prices each side's calls. From
that plan, on the generator's clock (:func:`price_sides`):

* one decode iteration of the generation side, ``iter_s``: the rollout calls' priced
  seconds over the decode iterations the cost model priced them with (a refilling
  call's expected steps, :func:`~planner.graph.refill.refill_shape`; a call in waves,
  its groups of waves times a group's expected longest row), prefills included;
* the training side's step, ``train_iters``: the span of one step's calls on that side
  in the plan's timeline (the sends of the batch, scoring, training), plus the host's
  work between steps, in decode iterations (rounded up); its scoring calls priced at the
  batch the buffer keeps (:func:`stream_train_graph`: DAPO's plan scores the rows it
  over-generates, a stream drops the constant groups before it sends the batch);
* the weights' copy, ``update_iters``: the priced reallocation of the trained model to
  the generation side, in decode iterations (rounded up): the generator pauses for it.

The generator's slots are the rollout call's rows decoding at once over its
data-parallel ranks, one pool. Then the schedule (:mod:`planner.graph.streaming`) is
simulated over lengths drawn from the rollout call's distribution (``plan.lengths_from``
or ``algorithm.gen_len_*``; seeded by the search seed) for each staleness bound
``1 .. algorithm.max_staleness`` (the buffer holding ``k + 1`` batches); of the streams
within :data:`STALENESS_GAIN` of the fastest, the one dropping the fewest groups, then
the least stale, wins. The best split is the one whose best bound streams the fastest;
for it, every smaller buffer of whole batches is simulated too (a trainer-bound stream
with a buffer of one batch drops nothing where a larger one lets groups go stale). The one-step-ahead mode is
read from the same split plans (:func:`search_ahead`), so streaming costs the search no
second pass. Each side's layouts are the ones the one-step search chose for its split:
the stream prices them, it does not search the sides again.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from planner.cost.cost_config import CostModelConfig
from planner.cost.cost_model import CostModel
from planner.cost.profile import ProfileTable
from planner.cost.step_spread import call_time_sd
from planner.errors import InfeasibleError
from planner.graph.dataflow import MFC, DataflowGraph
from planner.graph.lengths import expected_call_tokens
from planner.graph.refill import refill_shape
from planner.graph.stream_steady import (
    draw_stream_lengths,
    lengths_needed,
    sim_scale,
    steady_stream,
)
from planner.graph.streaming import OnUpdate, StreamSettings
from planner.plan import ExecutionPlan, MFCAllocation
from planner.plan_streaming import greedy_rows
from planner.search.plan_build import build_plan
from planner.search.problem import Candidate, RoleModel, assemble, async_splits, held_bytes, host_s
from planner.search.search import search_split
from planner.search_settings import SearchSettings
from planner.specs.cluster import ClusterSpec
from planner.specs.streaming_plan import StreamingPlan

#: training steps averaged for a steady state (after the buffer has filled)
STEADY_STEPS = 16
#: streams within this share of the fastest count as equally fast (the simulation's
#: spread over its drawn lengths): of those, the fewest dropped groups, then the least
#: stale bound, then the smallest buffer win (:func:`pick_stream`)
STALENESS_GAIN = 0.01


@dataclass(frozen=True)
class Sides:
    """A split's two sides, priced on the generator's clock."""

    gen_gpus: int
    train_gpus: int
    slots: int              #: samples decoding at once on the generation side
    iter_s: float           #: one decode iteration of the generation side
    train_iters: int        #: the training side's step
    update_iters: int       #: the weights' copy to the generation side


def rollout_calls(graph: DataflowGraph) -> list[MFC]:
    """The generate calls of every step (not an evaluation's), in graph order."""
    return [m for m in graph.mfcs if m.kind == "generate" and not m.is_eval]


def decode_shape(mfc: MFC, a: MFCAllocation) -> tuple[float, int]:
    """(decode iterations the cost model prices the call with, rows decoding at once
    over its data-parallel ranks), the prefill's iteration counted.

    Example: 64 rows in 2 waves at DP2, PP1 (waves): 16 rows a wave, 32 slots; the
    iterations are 2 x the expected longest of 16 rows (the slower rank's)."""
    dp, pp, m = a.layout.dp, a.layout.pp, a.micro_batches
    n_local = max(1, mfc.n_seqs // dp)
    if mfc.refill:
        slots = math.ceil(n_local / m)
        g = min(m, pp, n_local)
        steps, _admits = refill_shape(mfc, slots, math.ceil(n_local / g), dp)
        return max(1.0, steps + 1.0), dp * g * slots
    b = mfc.n_seqs / dp / m
    g = min(m, pp)
    groups = math.ceil(m / g)
    return max(1.0, groups * expected_call_tokens(mfc, b, groups, dp)), max(1, round(dp * g * b))


def train_side_s(plan: ExecutionPlan) -> float:
    """One step of the training side in ``plan``'s timeline: from the first to the last
    of a steady step's events that are neither a rollout nor a reallocation, plus the
    host's work between steps."""
    it = min(1, plan.n_iters - 1)
    ev = [e for e in plan.timeline if e.iteration == it and e.kind not in ("generate", "realloc")]
    span = max(e.end_s for e in ev) - min(e.start_s for e in ev) if ev else 0.0
    return span + plan.step_overhead_s


def stream_train_graph(graph: DataflowGraph) -> DataflowGraph:
    """``graph`` as a stream's training side runs it: the batch it receives (the
    rollout's records, sent) and every step call scoring the rollout (the reference,
    the reward model, the actor's proximal forward) at the rows the actor trains
    (:func:`trained_seqs`). DAPO's graph sizes them for its over-generation (the
    rollout's rows); a stream drops the constant groups at the buffer, before the batch
    is sent. ``graph`` itself where they are the rows already. (The rollout call is
    resized for the sizes of the records it sends; the generator's side is priced on
    ``graph``.)"""
    rollout = rollout_calls(graph)[0]
    trained = trained_seqs(graph)
    if trained == rollout.n_seqs:
        return graph
    key = rollout.output_keys[0]
    calls = tuple(m.model_copy(update={"n_seqs": trained})
                  if m is rollout or (m.kind == "inference" and not m.is_eval
                                      and key in m.input_keys) else m
                  for m in graph.mfcs)
    return graph.model_copy(update={"mfcs": calls})


def priced_on(plan: ExecutionPlan, graph: DataflowGraph,
              profile: ProfileTable | None = None) -> ExecutionPlan:
    """``plan``'s allocations (meshes, layouts, micro-batches, offloads, engines, token
    budgets, as the search chose them) priced for ``graph`` (the plan's calls, of other
    rows) by the search's cost model and simulator: each call's time, memory and sends
    at the rows it runs, its micro-batches at most one per row of a data-parallel rank.
    ``profile``: the table the plan was searched with (none if it had none). On the
    plan's own graph it repeats the plan's timeline."""
    assert (profile is None) == (plan.profile is None), "price a plan with its own profile"
    models = {pm.role: RoleModel(pm.role, pm.spec, pm.head, pm.lora) for pm in plan.models}
    cost = CostModel(plan.cluster, plan.cost_config, profile)
    cands = []
    for m in graph.mfcs:
        a, rm = plan.allocation(m.name), models[m.role]
        lay = a.layout
        mb = max(1, min(a.micro_batches, m.n_seqs // lay.dp))
        how = (m, rm.spec, rm.head, a.mesh, lay, mb, a.optimizer_offload,
               a.train_state_offload, a.activation_recompute, a.engine,
               None if m.adapters_off else rm.lora, a.token_budget)
        c = cost.mfc_cost(*how)
        resident, weights = held_bytes(c, rm, m)
        cands.append([Candidate(a.mesh.first_gpu, a.mesh.n_gpus, lay.tp, lay.pp, lay.dp, mb,
                                (c.time_s + host_s(graph, m, plan.cost_config)) / m.every,
                                resident, c.activation_bytes, weights, a.optimizer_offload,
                                c.host_bytes, a.train_state_offload,
                                call_time_sd(cost, graph, *how) / m.every,
                                a.activation_recompute, a.engine, a.token_budget, lay.ep)])
    prob = assemble(graph, models, cost, cands, plan.n_iters)
    return build_plan(plan.name, prob, [0] * len(cands), plan.cost_config, plan.search,
                      plan.heuristics)


def price_sides(plan: ExecutionPlan, split: int, profile: ProfileTable | None = None) -> Sides:
    """``plan``'s (generation below ``split``) two sides on the generator's clock (the
    module docs). The training side is priced at the rows it receives: ``plan``'s
    allocations on :func:`stream_train_graph` (:func:`priced_on`; ``profile``: the
    table ``plan`` was searched with), not the over-generated rows DAPO's one-step
    plan scores, which would price its scoring calls at ``1 / (1 - share)`` times
    their rows. The calls are repriced rather than their events scaled by the rows'
    ratio: a call's time is not proportional to its rows (micro-batches of fewer rows,
    the expected longest of fewer responses, fixed costs), and the timeline's sends
    shrink with them."""
    calls = rollout_calls(plan.graph)
    assert calls, "a streaming plan needs a rollout"
    first = calls[0]
    iters, slots = decode_shape(first, plan.allocation(first.name))
    # the sampled rollout's iterations; a greedy one (ReMax's) decodes in the same
    # slots, one more sample a group (priced by the schedule), after the same copy
    iter_s = plan.allocation(first.name).time_s / iters
    update_s = sum(r.time_s for r in plan.reallocations if r.to_mfc == first.name)
    graph = stream_train_graph(plan.graph)
    train_side = plan if graph is plan.graph else priced_on(plan, graph, profile)
    return Sides(gen_gpus=split, train_gpus=plan.cluster.n_gpus - split, slots=slots,
                 iter_s=iter_s, train_iters=math.ceil(train_side_s(train_side) / iter_s),
                 update_iters=math.ceil(update_s / iter_s))


def trained_seqs(graph: DataflowGraph) -> int:
    """The sequences a step trains: the actor's train call's (the rollout's, but for
    DAPO, whose rollout is over-sized for the groups its dynamic sampling drops)."""
    return next(m.n_seqs for m in graph.mfcs if m.kind == "train" and m.role == "actor")


def stream_candidate(plan: ExecutionPlan, sides: Sides, group_size: int, k: int,
                     capacity_batches: int, on_update: OnUpdate, seed: int,
                     constant_share: float = 0.0) -> StreamingPlan:
    """One split's stream under staleness bound ``k`` with a buffer of
    ``capacity_batches`` batches (the groups decoding included), simulated; a batch is
    the groups a step trains, and a share ``constant_share`` of the finished groups is
    dropped at the buffer (DAPO's dynamic sampling: ``algorithm.dropped_group_frac``),
    so the generator makes ``1 / (1 - share)`` groups a trained one."""
    first = rollout_calls(plan.graph)[0]
    trained = trained_seqs(plan.graph)
    if first.n_seqs % group_size or trained % group_size:
        raise InfeasibleError(f"{first.n_seqs} rollouts a step do not split into groups of "
                              f"{group_size}", field="algorithm.samples_per_prompt")
    batch_groups = trained // group_size
    # ReMax: each group's greedy baseline is one more sample of the group
    group_size += greedy_rows(plan.graph) // batch_groups
    s = StreamSettings(group_size=group_size, batch_groups=batch_groups, slots=sides.slots,
                       train_iters=sides.train_iters, update_iters=sides.update_iters,
                       max_staleness=k, on_update=on_update,
                       capacity_groups=capacity_batches * batch_groups)
    lengths = draw_stream_lengths(first.lengths, first.gen_len,
                                  lengths_needed(s, STEADY_STEPS, constant_share), seed)
    q, f = sim_scale(s, first.gen_len)
    est = steady_stream(s, lengths, STEADY_STEPS, q, f, constant_share)
    step_s = est.iters_per_step * sides.iter_s
    return StreamingPlan(
        gen_gpus=sides.gen_gpus, train_gpus=sides.train_gpus, group_size=group_size,
        batch_groups=batch_groups, slots=sides.slots, train_iters=sides.train_iters,
        update_iters=sides.update_iters, max_staleness=k, on_update=on_update,
        capacity_groups=s.capacity(), iter_s=sides.iter_s, step_s=step_s,
        samples_per_s=trained / step_s, staleness_mean=est.staleness_mean,
        gen_idle_share=est.gen_idle_share, train_idle_share=est.train_idle_share,
        dropped_share=est.dropped_share)


def pick_stream(cands: list[StreamingPlan]) -> StreamingPlan:
    """Of streams within :data:`STALENESS_GAIN` of the fastest, the one that drops the
    fewest groups (to 0.1 %), then the least stale bound, then the smallest buffer."""
    fastest = min(c.step_s for c in cands)
    near = [c for c in cands if c.step_s <= fastest * (1 + STALENESS_GAIN)]
    return min(near, key=lambda c: (round(c.dropped_share, 3), c.max_staleness,
                                    c.capacity_groups))


def stream_plan(plan: ExecutionPlan, sides: Sides, group_size: int, max_staleness: int,
                on_update: OnUpdate, seed: int, buffers: bool = False,
                constant_share: float = 0.0) -> StreamingPlan:
    """One split's best stream (the module docs): each bound ``k`` with a buffer of
    ``k + 1`` batches; ``buffers``: every smaller buffer of whole batches too."""
    cands = [stream_candidate(plan, sides, group_size, k, j, on_update, seed,
                              constant_share)
             for k in range(1, max_staleness + 1)
             for j in (range(1, k + 2) if buffers else (k + 1,))]
    return pick_stream(cands)


def with_stream(plan: ExecutionPlan, st: StreamingPlan) -> ExecutionPlan:
    """``plan`` streaming as ``st`` says: its estimate is the stream's step (checked
    against its allocations: :func:`planner.plan_streaming.streaming_problems`)."""
    return ExecutionPlan.model_validate({**plan.model_dump(), "streaming": st.model_dump(),
                                         "iteration_time_s": st.step_s, "slower_side_s": 0.0})


def search_ahead(name: str, graph: DataflowGraph, models: dict[str, RoleModel],
                 cluster: ClusterSpec, group_size: int, on_update: OnUpdate,
                 cost_config: CostModelConfig | None = None,
                 profile: ProfileTable | None = None, settings: SearchSettings | None = None,
                 constant_share: float = 0.0) -> tuple[ExecutionPlan, ExecutionPlan]:
    """(the fastest one-step-ahead plan, the fastest streaming plan) of an asynchronous
    ``graph`` (the module docs): each split searched once, with an equal share of the
    time limit, and both modes read from the same split plans (one step ahead: the
    split whose plan is estimated fastest, as :func:`~planner.search.search.search`
    chooses; streaming: the split whose stream is). ``constant_share``: DAPO's expected
    share of constant groups, dropped at the stream's buffer (:func:`stream_candidate`)."""
    assert graph.ahead_steps > 0, "the streaming search places an asynchronous graph"
    s = settings or SearchSettings()
    splits = async_splits(cluster)
    if not splits:
        raise InfeasibleError(f"a streaming plan generates and trains on separate GPUs; "
                              f"{cluster.describe()} has one", field="cluster")
    share = s.model_copy(update={"time_limit_s": s.time_limit_s / len(splits)})
    ahead: ExecutionPlan | None = None
    best: tuple[ExecutionPlan, Sides, StreamingPlan] | None = None
    why = ""
    for split in splits:
        try:
            plan = search_split(name, graph, models, cluster, split, cost_config, profile,
                                share)
        except InfeasibleError as e:
            why = e.message
            continue
        if ahead is None or plan.iteration_time_s < ahead.iteration_time_s:
            ahead = plan
        sides = price_sides(plan, split, profile)
        st = stream_plan(plan, sides, group_size, graph.max_staleness, on_update, s.seed,
                         constant_share=constant_share)
        if best is None or st.step_s < best[2].step_s:
            best = (plan, sides, st)
    if ahead is None or best is None:
        raise InfeasibleError(f"no plan that generates on GPUs of its own fits: {why}",
                              field="cluster")
    plan, sides, _ = best            # the best split's buffer: every size of whole batches
    return ahead, with_stream(plan, stream_plan(plan, sides, group_size,
                                                graph.max_staleness, on_update, s.seed,
                                                buffers=True, constant_share=constant_share))
