"""Plans written by hand (``plan.manual``) and saved plans (``plan.file``): priced and
checked by the same cost model and simulator as searched plans."""
from __future__ import annotations

from planner.cost.cost_config import CostModelConfig
from planner.cost.cost_model import CostModel
from planner.cost.offload_terms import offload_options, state_offload_options
from planner.cost.profile import ProfileTable
from planner.cost.step_spread import call_time_sd
from planner.cost.vllm_cost import VLLM_MAX_LORA_RANK
from planner.errors import PlanError
from planner.graph.dataflow import DataflowGraph
from planner.plan import ExecutionPlan, SearchInfo
from planner.search.plan_build import build_plan
from planner.search.problem import Candidate, RoleModel, assemble, held_bytes, host_s
from planner.search.simulator import simulate
from planner.specs.cluster import ClusterSpec
from planner.specs.layout import Allocation, check_allocation
from planner.specs.lora import LoraSpec

GIB = 2 ** 30


def manual_plan(name: str, graph: DataflowGraph, models: dict[str, RoleModel],
                cluster: ClusterSpec, allocations: dict[str, Allocation],
                cost_config: CostModelConfig | None = None, field: str = "plan.manual",
                profile: ProfileTable | None = None) -> ExecutionPlan:
    """The plan that runs each MFC where ``allocations`` says; errors name the MFC."""
    cost_config = cost_config or CostModelConfig()
    names = [m.name for m in graph.mfcs]
    missing = [n for n in names if n not in allocations]
    extra = [n for n in allocations if n not in names]
    if missing or extra:
        raise PlanError(f"needs exactly the MFCs {', '.join(names)}"
                        + (f"; missing {', '.join(missing)}" if missing else "")
                        + (f"; unknown {', '.join(extra)}" if extra else ""), field=field)
    cost = CostModel(cluster, cost_config, profile)
    for m in graph.mfcs:
        check_allocation(allocations[m.name], models[m.role].spec, m, cluster,
                         f"{field}.{m.name}")
    cands = []
    for m in graph.mfcs:
        a, rm = allocations[m.name], models[m.role]
        # a hand-made layout has no search to choose offload or recompute: 'always' gives
        # it, 'auto' and 'never' do not
        off, state_off, rc = (opts[0] if len(opts) == 1 else False for opts in (
            offload_options(cost_config, cost.cluster.device, m),
            state_offload_options(cost_config, cost.cluster.device, m), cost.recompute_options(m)))
        engines = cost.engine_options(m, a.layout, a.micro_batches)
        if not engines:
            raise PlanError(f"runs on vLLM (rollout.engine {cost_config.generate_engine}), "
                            "which runs one engine per data-parallel rank at the "
                            "call's tp, every expert on each: give it pp 1, ep 1 and "
                            "micro_batches 1 (got "
                            f"{a.layout}, {a.micro_batches})",
                            field=f"{field}.{m.name}")
        # several engines (rollout.engine auto): the faster one on this allocation
        if rm.lora is not None and rm.lora.rank > VLLM_MAX_LORA_RANK:
            engines = tuple(e for e in engines if e != "vllm") or ("own",)
        eng, c = min(((e, cost.mfc_cost(m, rm.spec, rm.head, a.mesh, a.layout,
                                        a.micro_batches, off, state_off, rc, e, rm.lora))
                      for e in engines), key=lambda ec: ec[1].time_s)
        resident, weights = held_bytes(c, rm, m)
        cands.append([Candidate(a.mesh.first_gpu, a.mesh.n_gpus, a.layout.tp, a.layout.pp,
                                a.layout.dp, a.micro_batches,
                                (c.time_s + host_s(graph, m, cost_config)) / m.every,
                                resident,
                                c.activation_bytes, weights, off, c.host_bytes,
                                state_off,
                                call_time_sd(cost, graph, m, rm.spec, rm.head, a.mesh,
                                             a.layout, a.micro_batches, off, state_off, rc,
                                             eng, rm.lora)
                                / m.every, rc, eng, ep=a.layout.ep)])
    prob = assemble(graph, models, cost, cands)
    res = simulate(prob, [0] * len(cands))
    if not res.feasible:
        g = max(range(prob.n_gpus), key=lambda x: res.peak_bytes[x])
        users = [m.name for m, cs in zip(graph.mfcs, cands)
                 if cs[0].first_gpu <= g < cs[0].first_gpu + cs[0].n_gpus]
        raise PlanError(f"does not fit in memory: GPU {g} needs {res.peak_bytes[g] / GIB:.2f} GiB "
                        f"for {', '.join(users)}, more than the {prob.mem_limit_bytes / GIB:.2f} "
                        "GiB usable", field=field)
    info = SearchInfo(method="manual", seed=0, search_time_s=0.0, space_size=1.0,
                      candidates={n: 1 for n in names}, steps=0, complete=True)
    return build_plan(name, prob, [0] * len(cands), cost_config, info, ())


def check_plan_matches(plan: ExecutionPlan, graph: DataflowGraph, models: dict[str, RoleModel],
                       cluster: ClusterSpec, field: str = "plan.file") -> None:
    """A saved plan must be for this cluster, these models and this graph."""
    if plan.cluster != cluster:
        raise PlanError(f"the plan is for the cluster {plan.cluster.describe()}; this "
                        f"experiment has {cluster.describe()}", field=field)
    planned, wanted = executed(plan.graph), executed(graph)
    if planned != wanted:
        raise PlanError(f"the plan is for another dataflow graph: {graph_diff(planned, wanted)}",
                        field=field)
    for pm in plan.models:
        rm = models.get(pm.role)
        if rm is None or rm.spec.model_dump(exclude={"name"}) != pm.spec.model_dump(exclude={"name"}):
            raise PlanError(f"the plan's {pm.role} model differs from the experiment's",
                            field=field)
        if pm.lora != rm.lora:      # LoRA changes what trains, what moves and its costs
            raise PlanError(f"the plan's {pm.role} has LoRA {_lora_text(pm.lora)}, the "
                            f"experiment's {_lora_text(rm.lora)} (lora.{pm.role}); plan "
                            "again", field=field)


def _lora_text(lora: LoraSpec | None) -> str:
    if lora is None:
        return "none"
    shared = " with one A per fused layer" if lora.shared_a else ""
    return f"rank {lora.rank} on {', '.join(lora.target_modules)}{shared}"


#: MFC fields that only price a call (the length distributions); a plan priced with
#: other ones runs the same calls
PRICING_ONLY = ("lengths", "prompt_lengths")


def executed(graph: DataflowGraph) -> DataflowGraph:
    """``graph`` without what only prices it (:data:`PRICING_ONLY`): what a run executes."""
    blank = dict.fromkeys(PRICING_ONLY)
    return graph.model_copy(update={"mfcs": tuple(m.model_copy(update=blank)
                                                  for m in graph.mfcs)})


def graph_diff(planned: DataflowGraph, wanted: DataflowGraph) -> str:
    """How the plan's graph differs from the experiment's, in a few words."""
    if planned.algorithm != wanted.algorithm:
        return f"algorithm {planned.algorithm} in the plan, {wanted.algorithm} here"
    a, b = [m.name for m in planned.mfcs], [m.name for m in wanted.mfcs]
    if a != b:
        return f"MFCs {a} in the plan, {b} here"
    for pm, wm in zip(planned.mfcs, wanted.mfcs):
        fields = [f for f in type(pm).model_fields if getattr(pm, f) != getattr(wm, f)]
        if fields:
            return "; ".join(f"{pm.name}.{f} is {getattr(pm, f)!r} in the plan, "
                             f"{getattr(wm, f)!r} here" for f in fields)
    return (f"rule rewards {[r.out_key for r in planned.rule_rewards]} in the plan, "
            f"{[r.out_key for r in wanted.rule_rewards]} here")
