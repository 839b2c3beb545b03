"""Turn a solved search problem (an assignment) into an :class:`ExecutionPlan`."""
from __future__ import annotations

from dataclasses import replace

from planner.cost.cost_config import CostModelConfig
from planner.plan import (
    ExecutionPlan,
    HeuristicResult,
    MFCAllocation,
    PlannedModel,
    ProfileRef,
    Reallocation,
    SearchInfo,
    TimelineEvent,
)
from planner.search.problem import Problem
from planner.search.simulator import simulate


def describe_candidate(prob: Problem, i: int, j: int) -> str:
    c = prob.cands[i][j]
    engine = " vllm" if c.engine == "vllm" else ""
    budget = f" budget {c.token_budget} tok" if c.token_budget is not None else ""
    return (f"{c.mesh().name(prob.cluster.gpus_per_node)} {c.layout()} "
            f"x{c.micro_batches}mb{engine}{budget}")


def build_plan(name: str, prob: Problem, assign: list[int], cost_config: CostModelConfig,
               info: SearchInfo, heuristics: tuple[HeuristicResult, ...]) -> ExecutionPlan:
    res = simulate(prob, assign, record=True)
    # what the slower side of each step adds: the same step with no spread
    slower = 0.0
    if any(prob.cands[i][j].time_sd_s > 0 for i, j in enumerate(assign)):
        flat = replace(prob, cands=[[replace(c, time_sd_s=0.0) for c in cs]
                                    for cs in prob.cands])
        slower = max(0.0, res.iter_time_s - simulate(flat, assign).iter_time_s)
    gpn = prob.cluster.gpus_per_node
    allocs = []
    for i, m in enumerate(prob.graph.mfcs):
        c = prob.cands[i][assign[i]]
        mesh = c.mesh()
        allocs.append(MFCAllocation(
            mfc=m.name, role=m.role, kind=m.kind, mesh=mesh, mesh_name=mesh.name(gpn),
            layout=c.layout(), micro_batches=c.micro_batches, time_s=c.time_s * m.every,
            mem_bytes=max(res.peak_bytes[g] for g in mesh.gpus), optimizer_offload=c.offload,
            host_bytes=c.host_bytes, train_state_offload=c.state_offload,
            activation_recompute=c.recompute, engine=c.engine, token_budget=c.token_budget))
    reallocs = []
    for (model, i), (t, nbytes) in sorted(res.realloc.items()):
        src = prob.cands[prob.model_train_mfc[model]][assign[prob.model_train_mfc[model]]]
        dst = prob.cands[i][assign[i]]
        reallocs.append(Reallocation(
            role=prob.models[model].role, to_mfc=prob.graph.mfcs[i].name,
            src_mesh=src.mesh(), src_layout=src.layout(), dst_mesh=dst.mesh(),
            dst_layout=dst.layout(), bytes=nbytes, time_s=t))
    models = tuple(PlannedModel(role=rm.role, spec=rm.spec, head=rm.head,
                                trainable=prob.model_train_mfc[k] >= 0, lora=rm.lora)
                   for k, rm in enumerate(prob.models))
    events = tuple(TimelineEvent(name=e.name, kind=e.kind, iteration=e.iteration,
                                 start_s=e.start_s, end_s=e.end_s, gpus=e.gpus)
                   for e in res.events)
    return ExecutionPlan(
        name=name, cluster=prob.cluster, models=models, graph=prob.graph,
        cost_config=cost_config, allocations=tuple(allocs), reallocations=tuple(reallocs),
        timeline=events, n_iters=prob.n_iters, iteration_time_s=res.iter_time_s,
        step_overhead_s=prob.step_overhead_s, slower_side_s=slower,
        mem_limit_bytes=prob.mem_limit_bytes, peak_mem_bytes=tuple(res.peak_bytes),
        search=info, heuristics=heuristics, profile=profile_ref(prob),
        cost_sources=dict(prob.cost_sources))


def profile_ref(prob: Problem) -> ProfileRef | None:
    t = prob.profile
    if t is None:
        return None
    return ProfileRef(path=t.source, device=t.device, dtype=t.measured.dtype,
                      host=t.measured.host, date=t.measured.date,
                      schema_version=t.schema_version)
