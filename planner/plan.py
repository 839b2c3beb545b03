"""ExecutionPlan: the frozen, versioned, serialisable result of planning.

It names things (models by role, MFCs by name, meshes by GPU range) and holds no
live objects, so it round-trips through JSON without loss and a saved plan can be
executed again without searching (``realign run`` reads it unchanged).
"""
from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from planner.cluster import ClusterSpec
from planner.cost_config import CostModelConfig
from planner.errors import PlanError
from planner.graph import DataflowGraph
from planner.layout import Layout
from planner.mesh import DeviceMesh
from planner.model_spec import ModelSpec

PLAN_SCHEMA_VERSION = 1


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PlannedModel(_Frozen):
    role: str
    spec: ModelSpec
    head: str = Field(description="lm | value")
    trainable: bool


class MFCAllocation(_Frozen):
    """Where one MFC runs and what it is estimated to cost."""

    mfc: str
    role: str
    kind: str
    mesh: DeviceMesh
    mesh_name: str
    layout: Layout
    micro_batches: int
    time_s: float = Field(description="Estimated duration of one call.")
    mem_bytes: float = Field(description="Peak memory per GPU of its mesh while it runs.")


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
    iteration_time_s: float | None = Field(description="None when it does not fit in memory.")
    allocations: dict[str, str] = Field(default_factory=dict,
                                        description="MFC -> 'mesh layout xMB' summary.")


class SearchInfo(_Frozen):
    method: str = Field(description="exact | anneal | manual")
    seed: int
    search_time_s: float
    space_size: float = Field(description="Number of complete assignments in the space.")
    candidates: dict[str, int] = Field(description="Candidate allocations per MFC.")
    steps: int = Field(description="Annealing steps or branch-and-bound nodes.")
    complete: bool = Field(description="exact: the whole space was searched.")


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
    mem_limit_bytes: float
    peak_mem_bytes: tuple[float, ...] = Field(description="Peak memory of each GPU.")
    search: SearchInfo
    heuristics: tuple[HeuristicResult, ...]

    def allocation(self, mfc: str) -> MFCAllocation:
        for a in self.allocations:
            if a.mfc == mfc:
                return a
        raise KeyError(mfc)

    def to_json(self) -> str:
        return self.model_dump_json(indent=1)

    @staticmethod
    def from_json(text: str, source: str = "plan") -> "ExecutionPlan":
        try:
            plan = ExecutionPlan.model_validate_json(text)
        except ValidationError as e:
            err = e.errors()[0]
            loc = ".".join(str(x) for x in err["loc"])
            raise PlanError(f"{source} is not a valid execution plan: {loc}: {err['msg']}",
                            field="plan") from None
        if plan.schema_version != PLAN_SCHEMA_VERSION:
            raise PlanError(f"{source} has schema_version {plan.schema_version}; this realign "
                            f"reads {PLAN_SCHEMA_VERSION}", field="plan")
        return plan

    @staticmethod
    def load(path: str | Path) -> "ExecutionPlan":
        p = Path(path)
        if not p.is_file():
            raise PlanError(f"no plan file at {str(p)!r}", field="plan")
        return ExecutionPlan.from_json(p.read_text(), source=str(p))
