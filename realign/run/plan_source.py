"""The plan ``realign run`` executes (:func:`resolve_plan`): a saved plan file checked
against the experiment, manual allocations on the experiment's graph
(:func:`manual_graph`), or a search."""
from __future__ import annotations

from pathlib import Path

from planner.errors import PlanError
from planner.graph.dataflow import DataflowGraph
from planner.graph.proximal import PROXIMAL_MFC
from planner.plan import ExecutionPlan
from planner.search.problem import RoleModel
from realign.config.experiment import ExperimentConfig
from realign.errors import UserError
from realign.run.planning import (
    allows_async,
    cost_config,
    experiment_graph,
    load_profile,
    plan_experiment,
)


def resolve_plan(cfg: ExperimentConfig, models: dict[str, RoleModel]) -> ExecutionPlan:
    """The plan ``realign run`` executes: a saved file, manual allocations, or a search."""
    from planner.search.manual import check_plan_matches, manual_plan
    from planner.specs.layout import Allocation

    cluster = cfg.cluster.spec()
    if cfg.plan.file and cfg.plan.manual:
        raise UserError("give plan.file or plan.manual, not both", field="plan")
    if cfg.plan.file:
        p = Path(cfg.plan.file)
        try:
            plan = ExecutionPlan.load(p)
        except PlanError as e:
            raise PlanError(e.message, field="plan.file") from None
        if plan.asynchronous and not allows_async(cfg):
            raise UserError(f"{p} runs generation ahead of training (asynchronous), but "
                            f"algorithm.max_staleness is {cfg.algorithm.max_staleness}; set it "
                            "to 1 or more, or plan again", field="plan.file")
        check_plan_matches(plan, experiment_graph(cfg, models, plan.asynchronous),
                           models, cluster)
        return plan
    if cfg.plan.manual:
        graph = manual_graph(cfg, models, list(cfg.plan.manual))
        allocs = {k: Allocation(mesh=v.mesh, layout=v.layout, micro_batches=v.micro_batches)
                  for k, v in cfg.plan.manual.items()}
        return manual_plan(cfg.name, graph, models, cluster, allocs,
                           cost_config(cfg, host_work=True), profile=load_profile(cfg))
    return plan_experiment(cfg)


def manual_graph(cfg: ExperimentConfig, models: dict[str, RoleModel],
                 placed: list[str]) -> DataflowGraph:
    """The graph a ``plan.manual`` that places the calls ``placed`` runs: the
    asynchronous one where the experiment lets generation run ahead
    (``algorithm.max_staleness`` >= 1) and ``placed`` has :data:`PROXIMAL_MFC`, else
    the synchronous one (which has it too where vLLM may generate or with ``tis_cap``).
    A :class:`UserError` at ``plan.manual`` unless ``placed`` is exactly its calls: it
    lists them, what is missing and what is unknown, and why the proximal call is or
    is not in the graph."""
    asynchronous = PROXIMAL_MFC in placed and allows_async(cfg)
    graph = experiment_graph(cfg, models, asynchronous)
    names = [m.name for m in graph.mfcs]
    missing = [n for n in names if n not in placed]
    unknown = [n for n in placed if n not in names]
    if not (missing or unknown):
        return graph
    why = ""
    if PROXIMAL_MFC in missing:
        why = (f"; this run has {PROXIMAL_MFC} because "
               + (f"rollout.engine is {cfg.rollout.engine}" if cfg.rollout.scores_rollout()
                  else "algorithm.params.tis_cap is set"))
    elif PROXIMAL_MFC in unknown:
        why = (f"; {PROXIMAL_MFC} is in a run that generates ahead (algorithm.max_staleness "
               ">= 1), or where vLLM may generate (rollout.engine vllm or auto) or "
               "algorithm.params.tis_cap is set")
    raise UserError(f"needs one allocation for each call of this run's graph, exactly: "
                    f"{', '.join(names)}"
                    + (f"; missing {', '.join(missing)}" if missing else "")
                    + (f"; unknown {', '.join(unknown)}" if unknown else "") + why,
                    field="plan.manual")
