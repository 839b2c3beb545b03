"""ProfileTable: what ``realign profile`` measured on one machine, in the cost model's
own terms.

A versioned JSON file. Every entry replaces the matching analytic term of the device
preset (:mod:`planner.cost.rates` says which term came from where); a table never triggers
measuring. What it holds:

* ``gemm``: achieved FLOP/s of ``[rows, width] x [width, width]`` GEMMs over a grid
  of rows x width, forward alone and forward + backward (a training GEMM);
* ``mem_bytes_per_s``: streaming memory bandwidth;
* ``engines``: the fixed costs of realign's own engines (train, inference, prefill,
  one decode step), and of vLLM's prefill and decode steps when it was profiled where
  vLLM is installed, that no FLOP or byte count explains: per call, per micro-batch
  (a wave, in generation), per layer, per token and hidden unit, per token and
  vocabulary column, per parameter (the optimizer step); fitted to timed runs of the
  engines themselves on probe models (:mod:`planner.cost.engine_terms` defines each);
* ``collectives``: latency and bandwidth of all-reduce, all-gather, reduce-scatter,
  broadcast and point-to-point by group size, within a node (and across nodes when
  profiled under a launcher), with the measured points;
* ``realloc`` and ``send``: fixed cost and throughput of a parameter reallocation and
  of a record sent between meshes; ``vllm_load``: of replacing a vLLM engine's weights.
"""
from __future__ import annotations

import bisect
import math
from pathlib import Path
from typing import Iterable, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from planner.errors import PlanError, from_validation

#: 2: measured GEMM grid, engine fixed costs, collectives, transfers (1 held rates only).
PROFILE_SCHEMA_VERSION = 2

#: realign's own engines, and vLLM's prefill and decode steps (a generate call with
#: ``rollout.engine`` vllm; :mod:`planner.cost.vllm_cost`)
EngineKind = Literal["train", "inference", "prefill", "decode", "vllm_prefill", "vllm_decode"]
CollectiveOp = Literal["all_reduce", "all_gather", "reduce_scatter", "broadcast", "p2p",
                       "all_to_all"]


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class GemmGrid(_Frozen):
    """Achieved FLOP/s of ``x [rows, width] @ W [width, width]``; ``train``: forward and
    both backward GEMMs (6 rows width^2 FLOPs)."""

    rows: tuple[int, ...] = Field(min_length=1, description="GEMM rows (ascending).")
    widths: tuple[int, ...] = Field(min_length=1, description="Square weight sizes (ascending).")
    forward_flops_per_s: tuple[tuple[float, ...], ...] = Field(
        description="[rows][widths] forward FLOP/s.")
    train_flops_per_s: tuple[tuple[float, ...], ...] = Field(
        description="[rows][widths] forward+backward FLOP/s.")

    @model_validator(mode="after")
    def _shape(self) -> "GemmGrid":
        for name in ("rows", "widths"):
            v = getattr(self, name)
            if list(v) != sorted(set(v)) or v[0] <= 0:
                raise ValueError(f"gemm.{name} must be positive and ascending")
        for name in ("forward_flops_per_s", "train_flops_per_s"):
            g = getattr(self, name)
            if len(g) != len(self.rows) or any(len(r) != len(self.widths) for r in g):
                raise ValueError(f"gemm.{name} must be [rows][widths]")
            if any(not (x > 0 and math.isfinite(x)) for r in g for x in r):
                raise ValueError(f"gemm.{name} must hold positive finite rates")
        return self

    def rate(self, rows: float, width: float, train: bool) -> float:
        """FLOP/s at ``rows`` x ``width``: bilinear in (log rows, log width) over the grid
        on the log of the rate, clamped to the grid's edges."""
        grid = self.train_flops_per_s if train else self.forward_flops_per_s
        i0, i1, a = _bracket(self.rows, rows)
        j0, j1, b = _bracket(self.widths, width)

        def lg(i: int, j: int) -> float:
            return math.log(grid[i][j])
        v = ((1 - a) * ((1 - b) * lg(i0, j0) + b * lg(i0, j1))
             + a * ((1 - b) * lg(i1, j0) + b * lg(i1, j1)))
        return math.exp(v)


def _bracket(axis: tuple[int, ...], x: float) -> tuple[int, int, float]:
    """Indices around ``x`` on ``axis`` and the weight of the upper one (log scale)."""
    if x <= axis[0] or len(axis) == 1:
        return 0, 0, 0.0
    if x >= axis[-1]:
        return len(axis) - 1, len(axis) - 1, 0.0
    hi = bisect.bisect_right(axis, x)
    lo = hi - 1
    return lo, hi, (math.log(x) - math.log(axis[lo])) / (math.log(axis[hi]) - math.log(axis[lo]))


class EngineCosts(_Frozen):
    """Fixed costs of one of realign's engines (seconds per unit; see
    :mod:`planner.cost.engine_terms` for where each is counted)."""

    call_s: float = Field(0.0, ge=0, description="Per call (train: per optimizer step).")
    microbatch_s: float = Field(0.0, ge=0, description="Per micro-batch through a stage "
                                "(prefill: per wave; decode: per wave and step).")
    layer_s: float = Field(0.0, ge=0, description="Per layer of a micro-batch (decode: of a "
                           "wave's step).")
    token_hidden_s: float = Field(0.0, ge=0, description="Per token x hidden unit x layer "
                                  "(norms, RoPE, activations, residuals: the work besides GEMMs).")
    token_vocab_s: float = Field(0.0, ge=0, description="Per output row x vocabulary column "
                                 "(log-softmax, sampling).")
    token_s: float = Field(0.0, ge=0, description="Per token of a micro-batch (the loss, "
                           "masks, bookkeeping).")
    param_s: float = Field(0.0, ge=0, description="Per local parameter (train: optimizer step, "
                           "gradient zeroing; 0 elsewhere).")
    collective_s: float = Field(0.0, ge=0, description="Per collective or point-to-point "
                                "message between the ranks of a call, beyond its measured "
                                "time: the ranks' skew and the waits it causes.")
    kernel_extra: float = Field(0.0, ge=0, description="Per second of priced GEMM and "
                                "attention work: how much longer the engine's kernels take "
                                "inside a model pass than the profile's GEMM grid times them "
                                "alone (weights and activations evicted by the other layers, "
                                "shapes besides the grid's squares, the attention kernel's "
                                "per-head overhead). Unitless.")
    lag: float = Field(0.0, ge=0, description="Per second of a call's priced work (GEMMs, "
                       "attention) when it runs on 2 ranks: how much later than the others "
                       "its slowest rank finishes, which the call waits for (every rank's "
                       "speed wanders: a shared core, a late wake-up); on n ranks scaled "
                       "by planner.cost.engine_terms.rank_lag. Unitless.")
    score_s: float = Field(0.0, ge=0, description="Per causal attention score (query x "
                           "earlier key x head x layer) of a whole-sequence pass (train, "
                           "inference): the mask and softmax over the score matrix, which "
                           "the attention's GEMM pricing leaves out; 0 where a fused kernel "
                           "never writes the scores out (the analytic default).")


def size_envelope(points: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """(bytes, seconds) points sorted by size, each time lowered to the least time of
    any larger message: moving more bytes never takes less time, so a point slower
    than a larger one was slowed by something else (on a shared machine a neighbour
    can stall one size's whole measurement). The measured points stay in the table.

    Example: [(8, 1e-4), (256, 3e-3), (4096, 3e-4)] -> [(8, 1e-4), (256, 3e-4), (4096, 3e-4)].
    """
    out = sorted((float(b), float(t)) for b, t in points)
    for i in range(len(out) - 2, -1, -1):
        out[i] = (out[i][0], min(out[i][1], out[i + 1][1]))
    return out


class CollectiveCurve(_Frozen):
    """One collective at one group size: its measured (tensor bytes, seconds) points,
    and their fit ``latency_s + algorithm bytes / bytes_per_s`` (algorithm bytes:
    all-reduce 2(n-1)/n S, all-gather and reduce-scatter (n-1)/n S of the whole tensor
    S, broadcast and p2p S). :meth:`time_s` interpolates between the points (a
    collective's speed changes with its size: caches, protocols) and uses the fit
    outside them."""

    op: CollectiveOp
    group_size: int = Field(ge=2)
    inter_node: bool = False
    latency_s: float = Field(ge=0)
    bytes_per_s: float = Field(gt=0)
    points: tuple[tuple[float, float], ...] = Field(
        default=(), description="Measured (message bytes, seconds).")

    def time_s(self, nbytes: float, alg_factor: float) -> float:
        """Seconds for a tensor of ``nbytes``: linear between the two measured points
        around it (their :func:`size_envelope`); below the smallest, the smallest's
        time; above the largest, the largest's time plus the rest at the fitted
        bandwidth."""
        pts = size_envelope(self.points)
        if len(pts) < 2:
            return self.latency_s + alg_factor * nbytes / self.bytes_per_s
        if nbytes <= pts[0][0]:
            return pts[0][1]
        for (b0, t0), (b1, t1) in zip(pts, pts[1:]):
            if nbytes <= b1:
                return t0 + (t1 - t0) * (nbytes - b0) / (b1 - b0)
        b1, t1 = pts[-1]
        return t1 + alg_factor * (nbytes - b1) / self.bytes_per_s


class TransferCosts(_Frozen):
    """``time = fixed_s + per_tensor_s x tensors + bytes / bytes_per_s``."""

    fixed_s: float = Field(0.0, ge=0)
    per_tensor_s: float = Field(0.0, ge=0)
    bytes_per_s: float = Field(gt=0)


class StepCosts(_Frozen):
    """realign's own host time of one step outside its calls and the experiment's batch:
    the controller sending the step to every worker, their walk of the program and
    their reports, the controller gathering and logging them. Seconds:
    ``fixed_s + per_worker_s x workers`` (every worker of the cluster takes part).

    Example: fixed 1e-4 s, 4e-4 s per worker, 2 workers: 9e-4 s."""

    fixed_s: float = Field(0.0, ge=0)
    per_worker_s: float = Field(0.0, ge=0)
    points: tuple[tuple[float, float], ...] = Field(
        (), description="Measured (workers, seconds per step) it was fitted to.")

    def time_s(self, workers: int) -> float:
        return self.fixed_s + self.per_worker_s * workers


class ProbePoint(_Frozen):
    """One timed engine run the fixed costs were fitted to."""

    engine: str = Field(description="inference | train | generate")
    model: tuple[int, int, int] = Field(description="(layers, hidden, vocabulary)")
    layout: tuple[int, int, int] = Field(description="(tp, pp, dp)")
    args: tuple[int, ...] = Field(description="inference/train: (sequences, tokens, "
                                  "micro-batches); generate: (prompts, prompt tokens, "
                                  "generated tokens, waves)")
    measured_s: float
    fitted_s: float


class Provenance(_Frozen):
    """Where and how the table was measured."""

    host: str = ""
    date: str = ""
    workers: int = Field(1, ge=1, description="Worker processes measured at once (one per device).")
    threads_per_worker: int = Field(1, ge=1)
    dtype: str = "fp32"
    torch: str = ""
    realign: str = ""
    duration_s: float = 0.0
    fit_rms_relative_error: dict[str, float] = Field(
        default_factory=dict, description="Per engine: RMS relative error of the fit over "
        "its probes (how well the fixed costs explain them).")
    probes: tuple[ProbePoint, ...] = Field((), description="The engine runs fitted.")
    passes: int = Field(1, ge=1, description="Passes over the GEMM grid and the engine "
                        "probes; each probe's time is the median of its samples over all "
                        "of them.")
    pass_time_ratios: tuple[float, ...] = Field(
        (), description="Per pass: how long its engine probes took relative to their "
        "pooled medians (the median over the probes; 1.0 typical, 1.3 a pass the machine "
        "ran 1.3x slow): how much the machine's speed moved while it was measured.")


class ProfileTable(_Frozen):
    schema_version: int = Field(PROFILE_SCHEMA_VERSION, description="Format version.")
    device: str = Field(description="Device preset the table was measured on.")
    measured: Provenance = Field(default_factory=Provenance)
    gemm: GemmGrid | None = None
    mem_bytes_per_s: float | None = Field(None, gt=0)
    host_link_bytes_per_s: float | None = Field(
        None, gt=0, description="Pinned host <-> device copy rate, mean of both directions "
        "(what optimizer and training-state offload move); None on the cpu device.")
    engines: dict[EngineKind, EngineCosts] = Field(default_factory=dict)
    collectives: tuple[CollectiveCurve, ...] = ()
    realloc: TransferCosts | None = None
    send: TransferCosts | None = None
    vllm_load: TransferCosts | None = Field(
        None, description="Replacing a vLLM engine's weights by realign's (written to "
        "shared memory, reloaded in place; per_tensor_s unused): measured by realign profile "
        "where vLLM is installed (realign.profile.vllm_probe).")
    step: StepCosts | None = Field(
        None, description="realign's own cost of a step outside its calls "
        "(realign.profile.step_overhead), paid once per step by every plan.")
    source: str = Field("", exclude=True, description="The file it was loaded from "
                        "(not stored in the table).")

    def collective(self, op: str, group_size: int, inter_node: bool) -> CollectiveCurve | None:
        """The curve of ``op`` measured at this group size (or the nearest measured size
        with the same node span), None when the table has none."""
        same = [c for c in self.collectives if c.op == op and c.inter_node == inter_node]
        if not same:
            return None
        return min(same, key=lambda c: (abs(math.log2(c.group_size) - math.log2(group_size)),
                                        -c.group_size))

    @staticmethod
    def load(path: str | Path) -> "ProfileTable":
        p = Path(path)
        if not p.is_file():
            raise PlanError(f"no profile table at {str(p)!r}", field="plan.profile")
        try:
            raw = p.read_bytes()
            import json
            version = json.loads(raw).get("schema_version")
        except (UnicodeDecodeError, OSError, ValueError, AttributeError) as e:
            raise PlanError(f"{p} is not a readable profile table ({e})",
                            field="plan.profile") from None
        if version != PROFILE_SCHEMA_VERSION:
            raise PlanError(f"{p} has schema_version {version}; this realign reads "
                            f"{PROFILE_SCHEMA_VERSION} (measure it again with realign profile)",
                            field="plan.profile")
        try:
            return ProfileTable.model_validate_json(raw).model_copy(update={"source": str(p)})
        except ValidationError as e:
            raise from_validation(e, ProfileTable, context=f"{p} is not a profile table: ",
                                  field="plan.profile", cls=PlanError) from None
