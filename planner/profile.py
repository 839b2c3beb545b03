"""ProfileTable: rates and MFC times measured on real hardware (``realign profile``).

A versioned JSON file. Where it has a value, the cost model uses it instead of the
analytic term; where it has none, the analytic term stands. Reading a table never
triggers measuring.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from planner.errors import PlanError

if TYPE_CHECKING:
    from planner.graph import MFC
    from planner.layout import Layout

PROFILE_SCHEMA_VERSION = 1


class MeasuredRates(BaseModel):
    """Achieved device rates (override peak x efficiency)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    matmul_flops_per_s: float | None = Field(None, gt=0, description="Achieved GEMM FLOP/s.")
    mem_bytes_per_s: float | None = Field(None, gt=0, description="Achieved memory bandwidth.")
    intra_node_bytes_per_s: float | None = Field(None, gt=0, description="Achieved intra-node bus bandwidth.")
    inter_node_bytes_per_s: float | None = Field(None, gt=0, description="Achieved inter-node bus bandwidth.")
    layer_overhead_s: float | None = Field(None, ge=0, description="Measured fixed cost per layer call.")
    microbatch_overhead_s: float | None = Field(None, ge=0,
                                                description="Measured fixed cost per micro-batch.")


class MeasuredMFC(BaseModel):
    """One measured MFC time, matched on model, kind, layout and batch shape."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str
    kind: str
    tp: int
    pp: int
    dp: int
    micro_batches: int
    n_seqs: int
    prompt_len: int
    gen_len: int
    time_s: float = Field(gt=0)


class ProfileTable(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: int = Field(PROFILE_SCHEMA_VERSION, description="Format version.")
    device: str = Field(description="Device preset the table was measured on.")
    rates: MeasuredRates = Field(default_factory=MeasuredRates)
    mfcs: tuple[MeasuredMFC, ...] = ()

    def lookup_mfc(self, model: str, mfc: "MFC", layout: "Layout", micro_batches: int) -> float | None:
        for e in self.mfcs:
            if (e.model, e.kind, e.tp, e.pp, e.dp, e.micro_batches, e.n_seqs, e.prompt_len,
                    e.gen_len) == (model, mfc.kind, layout.tp, layout.pp, layout.dp,
                                   micro_batches, mfc.n_seqs, mfc.prompt_len, mfc.gen_len):
                return e.time_s
        return None

    @staticmethod
    def load(path: str | Path) -> "ProfileTable":
        p = Path(path)
        if not p.is_file():
            raise PlanError(f"no profile table at {str(p)!r}", field="plan.profile")
        try:
            table = ProfileTable.model_validate_json(p.read_bytes())
        except (UnicodeDecodeError, OSError) as e:
            raise PlanError(f"{p} is not a readable profile table ({e})",
                            field="plan.profile") from None
        except ValidationError as e:
            raise PlanError(f"{p} is not a profile table: {e.errors()[0]['msg']}",
                            field="plan.profile") from None
        if table.schema_version != PROFILE_SCHEMA_VERSION:
            raise PlanError(f"{p} has schema_version {table.schema_version}; this realign "
                            f"reads {PROFILE_SCHEMA_VERSION}", field="plan.profile")
        return table
