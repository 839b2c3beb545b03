"""ExecutionPlan: the frozen, versioned, serialisable result of planning.

It names things (models by role, MFCs by name, meshes by GPU range) and holds no
live objects, so it round-trips through JSON without loss and a saved plan can be
executed again without searching (``realign run`` reads it unchanged).

A plan is consistent by construction (:func:`plan_problems`, checked whenever one is
made or read): one valid allocation per MFC of its graph, and exactly the
reallocations its allocations imply, so the run can execute what it lists.
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from planner.cost.cost_config import CostModelConfig
from planner.errors import PlanError, from_validation
from planner.graph.dataflow import MFC, DataflowGraph
from planner.graph.packing import PACK_BLOCK
from planner.plan_streaming import streaming_problems
from planner.specs.cluster import ClusterSpec
from planner.specs.layout import Layout, layout_problems, shard_placement
from planner.specs.lora import LoraSpec
from planner.specs.mesh import DeviceMesh
from planner.specs.model_spec import ModelSpec
from planner.specs.streaming_plan import StreamingPlan

#: 2: rule rewards in the graph, exact train inputs, fixed micro-batches, waves.
#: 3: optimizer offload per train call, the profile planned with, cost sources.
#: 4: asynchronous graphs (generation ahead of training), the sync/async comparison.
#: 5: recompute and offload per train call.
#: 6: the engine of each generate call (realign's own or vLLM).
#: 7: multi-turn generate calls (the graph's MFC.turns).
#: 8: LoRA per model (its adapters' settings; reallocations move only the adapters).
#: 9: packed calls (the graph's MFC.packed: priced by their bins' tokens).
#: 10: the token budget of each packed scoring call (tokens per micro-batch, chosen by the
#:     search); generate calls that refill their slots (the graph's MFC.refill).
#: 11: DAPO's sampling rounds (the graph's MFC.sampling_rounds: expected passes per step).
#: 12: the token budget of packed training calls too (bins of whole row groups; each
#:     micro-batch's loss weighted by its share of the mini-batch's normaliser).
#: 13: calls that run a LoRA model's base with its adapters off (the graph's
#:     MFC.adapters_off: the reference scored as the actor's base, one base in the plan).
#: 14: expert parallelism in each layout (Layout.ep, carved out of the data-parallel ranks).
#: 15: streaming plans (ExecutionPlan.streaming: the split, the stream's schedule and its
#:     predicted steady state); the streaming mode beside the other two in modes.
PLAN_SCHEMA_VERSION = 15


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PlannedModel(_Frozen):
    role: str
    spec: ModelSpec
    head: str = Field(description="lm | value")
    trainable: bool
    lora: LoraSpec | None = Field(None, description="LoRA adapters on a frozen base: only "
                                  "they (and a value head) train, and reallocations move "
                                  "only them.")


class MFCAllocation(_Frozen):
    """Where one MFC runs and what it is estimated to cost."""

    mfc: str
    role: str
    kind: str
    mesh: DeviceMesh
    mesh_name: str
    layout: Layout
    micro_batches: int = Field(gt=0, description="Micro-batches per step and replica.")
    time_s: float = Field(description="Estimated duration of one call.")
    mem_bytes: float = Field(description="Peak memory per GPU of its mesh while it runs.")
    optimizer_offload: bool = Field(
        False, description="Train calls: the optimizer state lives in host memory and the "
        "CPU steps it (megatron's HybridDeviceOptimizer, CUDA only).")
    host_bytes: float = Field(0.0, ge=0, description="Host memory per GPU it holds.")
    train_state_offload: bool = Field(
        False, description="Train calls: between calls the model keeps only its weights on "
        "the GPU; its gradients are freed and the optimizer state the GPU holds waits in "
        "host memory (plan.cost.train_state_offload).")
    activation_recompute: bool = Field(
        False, description="Train calls: each layer keeps only its input and runs its "
        "forward again in the backward (plan.cost.recompute).")
    engine: Literal["own", "vllm"] = Field(
        "own", description="Generate calls: realign's own engine (waves) or vLLM "
        "(continuous batching, one engine per GPU; rollout.engine).")
    token_budget: int | None = Field(
        None, gt=0, description="Packed scoring and training calls whose micro-batches "
        "are not fixed: the most tokens a bin (micro-batch) holds; each data-parallel rank "
        "packs its rows (a training call: one optimizer step's, in whole groups of "
        "group_size rows) first-fit decreasing into as many bins as that needs, and "
        "micro_batches is the expected bin count. None for every other call.")

    @property
    def shards(self) -> tuple[int, int, int, int, int]:
        """:func:`planner.specs.layout.shard_placement` of this allocation."""
        return shard_placement(self.mesh.first_gpu, self.mesh.n_gpus, self.layout.tp,
                               self.layout.pp, self.layout.ep)


class Reallocation(_Frozen):
    """Parameters of a trained model copied to another placement each iteration."""

    role: str
    to_mfc: str
    src_mesh: DeviceMesh
    src_layout: Layout
    dst_mesh: DeviceMesh
    dst_layout: Layout
    bytes: int = Field(description="Bytes moved (each destination's missing slices, once).")
    time_s: float


class TimelineEvent(_Frozen):
    name: str
    kind: str = Field(description="generate | inference | train | realloc")
    iteration: int
    start_s: float
    end_s: float
    gpus: tuple[int, ...]


class HeuristicResult(_Frozen):
    name: str
    iteration_time_s: float | None = Field(description="None when it does not fit in memory "
                                           "(or was not evaluated).")
    evaluated: bool = Field(True, description="False when planning ran out of "
                            "plan.time_limit_s before building it.")
    allocations: dict[str, str] = Field(default_factory=dict,
                                        description="MFC -> 'mesh layout xMB' summary.")
    not_applicable: str | None = Field(None, description="Why the heuristic cannot "
                                       "express a plan of this graph at all (None: it can).")


class SearchInfo(_Frozen):
    method: str = Field(description="exact | anneal | manual")
    seed: int
    search_time_s: float
    space_size: float = Field(description="Number of complete assignments in the space.")
    candidates: dict[str, int] = Field(description="Candidate allocations per MFC.")
    steps: int = Field(description="Annealing steps or branch-and-bound nodes.")
    complete: bool = Field(description="exact: the whole space was searched.")
    converged: bool = Field(False, description="anneal: every seed's walk converged (its "
                            "last chain gained < 0.5 %, or it fell 2 % behind the best walk) "
                            "before the steps or the time ran out.")


class ModeResult(_Frozen):
    """The best plan of one execution mode, when the experiment allows both
    (``algorithm.max_staleness`` >= 1): planning compares them and keeps the faster."""

    mode: str = Field(description="synchronous | asynchronous | streaming")
    iteration_time_s: float | None = Field(description="None: no plan of this mode fits.")
    chosen: bool
    allocations: dict[str, str] = Field(default_factory=dict,
                                        description="MFC -> 'mesh layout xMB' summary.")
    slower_side_s: float = Field(0.0, ge=0, description="The plan's slower_side_s.")
    gen_gpus: int | None = Field(None, description="GPUs of the generation side (the rest "
                                 "train); None: every call may use every GPU.")
    staleness_mean: float = Field(0.0, ge=0, description="Expected versions between a "
                                  "trained sample's weights and the trainer's.")
    gen_idle_share: float | None = Field(None, description="Share of a step the generation "
                                         "side waits; None: no side of its own.")
    train_idle_share: float | None = Field(None, description="Share of a step the training "
                                           "side waits; None: no side of its own.")


class ProfileRef(_Frozen):
    """The profile table a plan was priced with (``realign profile``'s output)."""

    path: str = Field(description="Where it was read from.")
    device: str
    dtype: str = Field(description="The dtype it measured in (the run's must match).")
    host: str
    date: str
    schema_version: int


class ExecutionPlan(_Frozen):
    schema_version: int = PLAN_SCHEMA_VERSION
    name: str
    cluster: ClusterSpec
    models: tuple[PlannedModel, ...]
    graph: DataflowGraph
    cost_config: CostModelConfig
    allocations: tuple[MFCAllocation, ...]
    reallocations: tuple[Reallocation, ...]
    timeline: tuple[TimelineEvent, ...]
    n_iters: int = Field(description="Iterations simulated for the estimate.")
    iteration_time_s: float
    step_overhead_s: float = Field(
        0.0, ge=0, description="Host seconds between two steps included in "
        "iteration_time_s: realign's own (the profile's) and the workers' batches.")
    slower_side_s: float = Field(
        0.0, ge=0, description="Seconds per step included in iteration_time_s because an "
        "asynchronous step lasts the slower of its two sides in each step, whose times "
        "spread with the generation lengths (planner.cost.step_spread); 0 otherwise.")
    mem_limit_bytes: float
    peak_mem_bytes: tuple[float, ...] = Field(description="Peak memory of each GPU.")
    search: SearchInfo
    heuristics: tuple[HeuristicResult, ...]
    profile: ProfileRef | None = Field(
        None, description="The profile table its estimates read, None: device preset only.")
    cost_sources: dict[str, str] = Field(
        default_factory=dict, description="Each rate the cost model used -> 'profile' or "
        "the device preset it came from.")
    modes: tuple[ModeResult, ...] = Field(
        (), description="The best synchronous and asynchronous plans side by side (empty "
        "unless algorithm.max_staleness >= 1), and the streaming one where "
        "rollout.mode is streaming.")
    streaming: StreamingPlan | None = Field(
        None, description="The generator streams into a rollout buffer on its own GPUs "
        "while the trainer trains (rollout.mode: streaming): the split, the schedule and "
        "its predicted steady state; None: the plan runs step by step.")

    @property
    def asynchronous(self) -> bool:
        """Rollout generation runs ahead of training (its graph says so)."""
        return self.graph.ahead_steps > 0

    @model_validator(mode="after")
    def _consistent(self) -> "ExecutionPlan":
        problems = plan_problems(self)
        if problems:
            raise PlanError("; ".join(problems), field="plan")
        return self

    def allocation(self, mfc: str) -> MFCAllocation:
        for a in self.allocations:
            if a.mfc == mfc:
                return a
        raise KeyError(mfc)

    def to_json(self) -> str:
        return self.model_dump_json(indent=1)

    @staticmethod
    def from_json(text: str, source: str = "plan") -> "ExecutionPlan":
        import json
        try:
            version = json.loads(text).get("schema_version")
        except (ValueError, AttributeError):
            version = None
        if version is not None and version != PLAN_SCHEMA_VERSION:
            raise PlanError(f"{source} has schema_version {version}; this realign reads "
                            f"{PLAN_SCHEMA_VERSION} (plan it again with realign plan)",
                            field="plan")
        try:
            return ExecutionPlan.model_validate_json(text)
        except ValidationError as e:
            raise from_validation(e, ExecutionPlan, context=f"{source} is not a valid "
                                  "execution plan: ", field="plan", cls=PlanError) from None
        except PlanError as e:
            raise PlanError(f"{source} is not a consistent execution plan: {e.message}",
                            field="plan") from None

    @staticmethod
    def load(path: str | Path) -> "ExecutionPlan":
        p = Path(path)
        if not p.is_file():
            raise PlanError(f"no plan file at {str(p)!r}", field="plan")
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError) as e:
            raise PlanError(f"{p} is not a readable plan file ({e})", field="plan") from None
        return ExecutionPlan.from_json(text, source=str(p))


def expected_reallocations(plan: ExecutionPlan) -> list[tuple[str, str]]:
    """(role, MFC) of every call that needs its model's parameters reallocated: a call of
    a trained model whose shard placement differs from its training call's, unless it
    runs the base with its adapters off (the rule of
    :func:`planner.search.simulator.needs_realloc`)."""
    train = {a.role: a for a in plan.allocations if a.kind == "train"}
    base = {m.name for m in plan.graph.mfcs if m.adapters_off}
    return [(a.role, a.mfc) for a in plan.allocations
            if a.role in train and a.kind != "train" and a.mfc not in base
            and a.shards != train[a.role].shards]


def budget_problems(a: MFCAllocation, m: MFC, where: str) -> list[str]:
    """Why ``a``'s token budget cannot run ``m`` (empty when it can, or has none): only
    packed scoring and training calls without fixed micro-batches have one, a multiple
    of :data:`~planner.graph.packing.PACK_BLOCK` that holds a row (a group of
    ``group_size`` rows: a preference pair) at its cap."""
    b = a.token_budget
    if b is None:
        return []
    if not (m.kind in ("inference", "train") and m.packed and m.micro_batches is None):
        return [f"{where}: token_budget is for packed scoring and training calls without "
                f"fixed micro-batches; this is a {m.kind} call (packed {m.packed}, "
                f"micro_batches {m.micro_batches})"]
    need = m.group_size * m.seq_len
    if b % PACK_BLOCK or b < need:
        rows = "a row" if m.group_size == 1 else f"a group of {m.group_size} rows"
        return [f"{where}: token_budget {b} must be a multiple of {PACK_BLOCK} of at least "
                f"the {need} tokens of {rows} at its cap"]
    return []


def plan_problems(plan: ExecutionPlan) -> list[str]:
    """Why ``plan`` cannot be executed as it is (empty when it can): allocations that
    do not match its graph, meshes outside its cluster, layouts its models or batches
    cannot take, and reallocations other than those its allocations imply."""
    out: list[str] = []
    mfcs = {m.name: m for m in plan.graph.mfcs}
    names = [a.mfc for a in plan.allocations]
    if names != list(mfcs):
        return [f"its allocations are for {names}, its graph has the MFCs {list(mfcs)}"]
    specs = {pm.role: pm.spec for pm in plan.models}
    if set(specs) != set(plan.graph.roles()):
        return [f"its models are {sorted(specs)}, its graph calls {sorted(plan.graph.roles())}"]
    gpn = plan.cluster.gpus_per_node
    loras = {pm.role for pm in plan.models if pm.lora is not None}
    for m in plan.graph.mfcs:
        if m.adapters_off and m.role not in loras:
            out.append(f"{m.name} runs the {m.role}'s base with its adapters off, but the "
                       f"plan's {m.role} has no LoRA")
    for a in plan.allocations:
        m = mfcs[a.mfc]
        where = f"allocation {a.mfc}"
        if (a.role, a.kind) != (m.role, m.kind):
            out.append(f"{where} is a {a.role} {a.kind} call, the graph's is a {m.role} "
                       f"{m.kind} call")
            continue
        try:
            a.mesh.validate_on(plan.cluster)
        except PlanError as e:
            out.append(f"{where}: {e.message}")
            continue
        if a.mesh_name != a.mesh.name(gpn):
            out.append(f"{where}: mesh_name {a.mesh_name!r} is not its mesh's name "
                       f"{a.mesh.name(gpn)!r}")
        # a token budget's bins are not a split of the rows: no count to divide them by
        out += [f"{where}: {p}" for p in layout_problems(
            a.layout, a.mesh, specs[a.role], m,
            a.micro_batches if a.token_budget is None else 1, plan.cluster)]
        out += budget_problems(a, m, where)
        if a.optimizer_offload and a.kind != "train":
            out.append(f"{where}: optimizer_offload is for train calls, this is a {a.kind} call")
        if a.train_state_offload and a.kind != "train":
            out.append(f"{where}: train_state_offload is for train calls, this is a "
                       f"{a.kind} call")
        if a.engine == "vllm" and (a.kind != "generate" or a.layout.pp != 1
                                   or a.micro_batches != 1):
            out.append(f"{where}: engine vllm runs generate calls at pp 1 (any tp) and one "
                       f"micro-batch; this is a {a.kind} call at {a.layout} x{a.micro_batches}")
        if a.activation_recompute and a.kind != "train":
            out.append(f"{where}: activation_recompute is for train calls, this is a "
                       f"{a.kind} call")
    if out:
        return out
    out += streaming_problems(plan)
    train = {a.role: a for a in plan.allocations if a.kind == "train"}
    want = expected_reallocations(plan)
    have = [(r.role, r.to_mfc) for r in plan.reallocations]
    if sorted(have) != sorted(want):
        out.append(f"it lists the reallocations {sorted(have)}; its allocations imply "
                   f"{sorted(want)}")
        return out
    for r in plan.reallocations:
        src, dst = train[r.role], plan.allocation(r.to_mfc)
        if (r.src_mesh, r.src_layout, r.dst_mesh, r.dst_layout) != (
                src.mesh, src.layout, dst.mesh, dst.layout):
            out.append(f"the reallocation of {r.role} to {r.to_mfc} goes {r.src_layout} on "
                       f"{r.src_mesh.name(gpn)} -> {r.dst_layout} on {r.dst_mesh.name(gpn)}, "
                       f"but the calls run {src.layout} on {src.mesh_name} and {dst.layout} "
                       f"on {dst.mesh_name}")
    return out
