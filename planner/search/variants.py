"""Distinct plans of one experiment, to measure against their estimates
(``realign bench plans``): the searched plan, every hand-written heuristic that fits,
and hand-made variants that span mesh splits, TP/PP/DP and micro-batches.

Pure: every plan is priced by the same cost model (and profile) as the search, and
built by the same code as a saved or manual plan, so what the bench runs is exactly
what it estimates. Variants are generated in a fixed order from the cluster and the
graph alone (never from a measurement), and duplicates (the same allocations) are
dropped.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

from planner.cost.cost_config import CostModelConfig
from planner.cost.cost_model import CostModel
from planner.cost.profile import ProfileTable
from planner.errors import PlanError
from planner.graph.dataflow import MFC, DataflowGraph
from planner.plan import ExecutionPlan, SearchInfo
from planner.search.heuristics import HEURISTICS
from planner.search.manual import manual_plan
from planner.search.plan_build import build_plan
from planner.search.problem import RoleModel, build_problem
from planner.search.search import SearchSettings, search
from planner.specs.cluster import ClusterSpec
from planner.specs.layout import Allocation, Layout, enumerate_layouts
from planner.specs.mesh import DeviceMesh

#: Per allocation: MFC, mesh first GPU and size, TP, PP, DP, EP and micro-batches.
PlanSignature = tuple[tuple[str, int, int, int, int, int, int, int], ...]


@dataclass(frozen=True)
class LabelledPlan:
    label: str             #: "searched", "heuristic megatron", "variant all TP2·PP1·DP1 x1", ...
    origin: str            #: searched | heuristic | variant
    plan: ExecutionPlan


def signature(plan: ExecutionPlan) -> PlanSignature:
    """What makes two plans the same plan: every allocation's mesh, layout and
    micro-batches."""
    return tuple((a.mfc, a.mesh.first_gpu, a.mesh.n_gpus, a.layout.tp, a.layout.pp,
                  a.layout.dp, a.layout.ep, a.micro_batches) for a in plan.allocations)


def _micro_batch_options(mfc: MFC, dp: int) -> list[int]:
    """Micro-batch counts an MFC may take at data-parallel degree ``dp``: its fixed
    count, or the powers of two that divide its share (at most 8)."""
    per = (mfc.n_seqs // (mfc.n_minibatches if mfc.kind == "train" else 1)) // dp
    per //= mfc.group_size
    if mfc.micro_batches is not None:
        return [mfc.micro_batches] if per % mfc.micro_batches == 0 else []
    return [m for m in (1, 2, 4, 8) if m <= per and per % m == 0]


def _layouts(mesh: DeviceMesh, models: dict[str, RoleModel], mfc: MFC,
             cluster: ClusterSpec) -> list[Layout]:
    return enumerate_layouts(mesh, models[mfc.role].spec, mfc, cluster)


#: which layout an MFC takes among those it allows (None: none suits)
LayoutChoice = Callable[[MFC, list[Layout]], "Layout | None"]


def _uniform(graph: DataflowGraph, models: dict[str, RoleModel], cluster: ClusterSpec,
             where: Callable[[MFC], DeviceMesh], layout_of: LayoutChoice, many: bool,
             upto: int | None = None) -> dict[str, Allocation] | None:
    """One allocation per MFC: mesh ``where(mfc)``, layout ``layout_of(mfc, layouts)``,
    the fewest (or, with ``many``, the most; with ``upto``, the most up to that many)
    micro-batches; None when one has none."""
    out = {}
    for m in graph.mfcs:
        mesh = where(m)
        lay = layout_of(m, _layouts(mesh, models, m, cluster))
        if lay is None:
            return None
        mbs = _micro_batch_options(m, lay.dp)
        if upto is not None:
            mbs = [k for k in mbs if k <= upto]
        if not mbs:
            return None
        out[m.name] = Allocation(mesh=mesh, layout=lay, micro_batches=mbs[-1] if many else mbs[0])
    return out


def _pick(tp: int, pp: int) -> LayoutChoice:
    def f(_m: MFC, lays: list[Layout]) -> Layout | None:
        return next((x for x in lays if (x.tp, x.pp) == (tp, pp)), None)
    return f


def _widest_dp(_m: MFC, lays: list[Layout]) -> Layout | None:
    return max(lays, key=lambda x: x.dp) if lays else None


def hand_variants(graph: DataflowGraph, models: dict[str, RoleModel], cluster: ClusterSpec
                  ) -> Iterator[tuple[str, dict[str, Allocation]]]:
    """(label, allocations) of the hand-made variants, in a fixed order that alternates
    the families: one layout for every call on the whole cluster (each TP/PP/DP),
    fewest and most micro-batches; generation and training on separate halves; every
    call on one half (the other idle); each model on its own half. Then the whole-
    cluster layouts at up to 2 and up to 4 micro-batches."""
    n = cluster.n_gpus
    full = DeviceMesh(first_gpu=0, n_gpus=n)
    half = n // 2 if n >= 2 and (n // 2 < cluster.gpus_per_node or
                                 (n // 2) % cluster.gpus_per_node == 0) else 0
    degrees = sorted({(lay.tp, lay.pp) for m in graph.mfcs
                      for lay in _layouts(full, models, m, cluster)},
                     key=lambda t: (t[0] * t[1], -t[0]))
    families: list[list[tuple[str, dict[str, Allocation] | None]]] = []
    for many in (False, True):
        fam = []
        for tp, pp in degrees:
            lay = Layout(tp=tp, pp=pp, dp=n // (tp * pp))
            fam.append((f"all {lay} {'most' if many else 'fewest'} micro-batches",
                        _uniform(graph, models, cluster, lambda m: full, _pick(tp, pp), many)))
        families.append(fam)
    if half:
        a, b = DeviceMesh(first_gpu=0, n_gpus=half), DeviceMesh(first_gpu=half, n_gpus=half)
        roles = list(dict.fromkeys(m.role for m in graph.mfcs))
        splits = [
            ("generation | the rest", lambda m: a if m.kind == "generate" else b),
            ("training | the rest", lambda m: a if m.kind == "train" else b),
            ("everything on one half", lambda m: a),
            ("models alternate halves", lambda m: a if roles.index(m.role) % 2 == 0 else b),
        ]
        for many in (False, True):
            families.append([(f"{label}, {'most' if many else 'fewest'} micro-batches",
                              _uniform(graph, models, cluster, where, _widest_dp, many))
                             for label, where in splits])
    # round-robin over the families: the first few variants already span all of them
    longest = max(len(f) for f in families)
    for k in range(longest):
        for fam in families:
            if k < len(fam):
                label, allocs = fam[k]
                if allocs is not None:
                    yield label, allocs
    # then the micro-batch counts in between, for clusters too small for the above to
    # give enough distinct plans (one GPU: no layouts, no splits)
    for upto in (2, 4):
        for tp, pp in degrees:
            lay = Layout(tp=tp, pp=pp, dp=n // (tp * pp))
            allocs = _uniform(graph, models, cluster, lambda m: full, _pick(tp, pp), True, upto)
            if allocs is not None:
                yield f"all {lay} up to {upto} micro-batches", allocs


def bench_plans(name: str, graph: DataflowGraph, models: dict[str, RoleModel],
                cluster: ClusterSpec, cost_config: CostModelConfig | None = None,
                profile: ProfileTable | None = None, settings: SearchSettings | None = None,
                n: int = 8) -> list[LabelledPlan]:
    """Up to ``n`` distinct plans: searched, then every heuristic that fits, then hand
    variants (each priced by the same cost model and profile); never two alike."""
    cost_config = cost_config or CostModelConfig()
    settings = settings or SearchSettings()
    out: list[LabelledPlan] = []
    seen: set[PlanSignature] = set()

    def add(label: str, origin: str, plan: ExecutionPlan) -> None:
        if len(out) < n and signature(plan) not in seen:
            seen.add(signature(plan))
            out.append(LabelledPlan(label, origin, plan))

    add("searched", "searched", search(name, graph, models, cluster, cost_config, profile,
                                       settings))
    prob = build_problem(graph, models, CostModel(cluster, cost_config, profile),
                         n_iters=settings.n_iters)
    info = SearchInfo(method="manual", seed=0, search_time_s=0.0, space_size=1.0,
                      candidates={m.name: 1 for m in graph.mfcs}, steps=0, complete=True)
    for hname, fn in HEURISTICS.items():
        assign = fn(prob)
        if assign is not None:
            add(f"heuristic {hname}", "heuristic",
                build_plan(name, prob, assign, cost_config, info, ()))
    for label, allocs in hand_variants(graph, models, cluster):
        if len(out) >= n:
            break
        try:
            plan = manual_plan(name, graph, models, cluster, allocs, cost_config,
                               profile=profile, field="variant")
        except PlanError:
            continue                      # does not fit in memory
        add(f"variant {label}", "variant", plan)
    return out
