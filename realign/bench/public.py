"""``realign bench public``: the planner's GPU estimates against published RLHF runs.

The calibration set is ``benchmarks/public_runs/runs.yaml``: per run the system that
measured it, an experiment YAML reproducing its setting (model, GPUs, batch, lengths,
engine), the source and the exact figure quoted from it, and the measured step time and
per-phase times where published. Each run is planned with its device preset (no
profile, a small search time limit; a run whose source publishes its placement and
micro-batches gives them as ``plan.manual``, which is priced as given instead of
searched) and compared, estimate / measured, per step and per phase:

- generation: the plan's generate calls;
- scoring: its inference calls (reference, reward, critic values, old log-probs);
- training: its train calls;
- weight sync: its reallocations.

A phase's estimate is the sum of its calls' estimates (each call runs once per step),
read from the plan's allocations, not from the timeline.

The error of a ratio ``r`` is ``max(r, 1/r) - 1``: 0.5 and 2.0 are both 100 % off.
``--out`` writes the whole record (settings, versions, every plan's per-call estimates
and the ratios); ``--summary`` writes the small summary that ``realign plan`` shows
beside its estimate (:func:`error_band_line`); nothing here runs at plan time.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from realign.errors import UserError

RUNS_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "public_runs"
DEFAULT_INDEX = RUNS_DIR / "runs.yaml"
DEFAULT_SUMMARY = RUNS_DIR / "summary.json"
PHASES = ("generation", "scoring", "training", "weight_sync")
KIND_PHASE = {"generate": "generation", "inference": "scoring", "train": "training"}


class Measured(BaseModel):
    """What the source published for one step (seconds)."""
    model_config = ConfigDict(extra="forbid")
    step_s: float = Field(gt=0, description="Time of one whole step.")
    generation_s: float | None = Field(None, gt=0, description="Rollout generation.")
    scoring_s: float | None = Field(None, gt=0, description="Reference / reward / critic / "
                                    "old log-prob forward passes together.")
    training_s: float | None = Field(None, gt=0, description="Actor (and critic) updates.")
    weight_sync_s: float | None = Field(None, gt=0, description="Weights from training "
                                        "to the generation engine.")


class PublicRun(BaseModel):
    """One published run of the calibration set."""
    model_config = ConfigDict(extra="forbid")
    id: str = Field(description="Short unique name.")
    system: str = Field(description="The system that measured it (verl, AReaL, ...).")
    experiment: str = Field(description="The experiment YAML reproducing the setting, "
                            "relative to the index file.")
    hardware: str = Field(description="The GPUs as the source names them (e.g. 16 x H800).")
    source: str = Field(description="Where the figure is published (URL, file, table).")
    quote: str = Field(description="The figure exactly as the source states it.")
    derived: str | None = Field(None, description="Arithmetic from the quoted figure to "
                                "step_s, where the source gives no step time.")
    measured: Measured


class RunIndex(BaseModel):
    model_config = ConfigDict(extra="forbid")
    runs: list[PublicRun]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--index", type=Path, default=DEFAULT_INDEX,
                   help="the calibration set (default benchmarks/public_runs/runs.yaml)")
    p.add_argument("--only", default=None, help="comma-separated run ids (default: all)")
    p.add_argument("--time-limit", type=float, default=30.0, dest="time_limit_s",
                   help="search time limit per run, seconds (default 30)")
    p.add_argument("--out", type=Path, default=None, help="write the JSON record here")
    p.add_argument("--summary", nargs="?", const=DEFAULT_SUMMARY, default=None, type=Path,
                   help="write the summary realign plan shows (default path: "
                        "benchmarks/public_runs/summary.json)")
    p.add_argument("--json", action="store_true", help="print the JSON record")


def load_index(path: Path) -> RunIndex:
    if not path.is_file():
        raise UserError(f"no calibration set at {str(path)!r}", field="--index")
    try:
        idx = RunIndex.model_validate(yaml.safe_load(path.read_text()))
    except ValidationError as e:
        raise UserError(f"{path}: {e}", field="--index") from None
    ids = [r.id for r in idx.runs]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise UserError(f"{path}: run ids appear twice: {', '.join(dup)}", field="--index")
    return idx


def select(idx: RunIndex, only: str | None) -> list[PublicRun]:
    if not only:
        return list(idx.runs)
    want = [s.strip() for s in only.split(",") if s.strip()]
    known = {r.id: r for r in idx.runs}
    bad = [w for w in want if w not in known]
    if bad:
        raise UserError(f"unknown run id(s) {', '.join(bad)}; allowed: "
                        f"{', '.join(known)}", field="--only")
    return [known[w] for w in want]


# ---- pure arithmetic ------------------------------------------------------------------

def phase_estimates(plan: dict) -> dict[str, float]:
    """Per phase, the sum of its calls' estimated seconds, from a plan's JSON
    (``allocations`` with ``kind`` and ``time_s``, ``reallocations`` with ``time_s``)."""
    out = dict.fromkeys(PHASES, 0.0)
    for a in plan["allocations"]:
        out[KIND_PHASE[a["kind"]]] += a["time_s"]
    out["weight_sync"] = sum(r["time_s"] for r in plan["reallocations"])
    return out


def error_of(ratio: float) -> float:
    """How far off a ratio is, symmetric in over and under: ``max(r, 1/r) - 1``."""
    return max(ratio, 1.0 / ratio) - 1.0


def compare(measured: Measured, estimate_step_s: float, phases: dict[str, float]) -> dict:
    """Estimate / measured for the step and every phase the source published."""
    ratios = {"step": estimate_step_s / measured.step_s}
    for ph in PHASES:
        m = getattr(measured, f"{ph}_s")
        if m is not None:
            ratios[ph] = phases[ph] / m
    return ratios


def band(ratios: list[float]) -> dict | None:
    """Median and worst of step ratios (None: no ratio)."""
    if not ratios:
        return None
    worst = max(ratios, key=error_of)
    return {"n_runs": len(ratios), "median_ratio": statistics.median(ratios),
            "median_error_pct": 100 * statistics.median(error_of(r) for r in ratios),
            "worst_ratio": worst, "worst_error_pct": 100 * error_of(worst)}


def summarize(rows: list[dict]) -> dict:
    """The step-ratio band over all runs and per device preset, and per phase."""
    ok = [r for r in rows if r.get("ratios")]
    devices = sorted({r["device"] for r in ok})
    return {
        "all": band([r["ratios"]["step"] for r in ok]),
        "by_device": {d: band([r["ratios"]["step"] for r in ok if r["device"] == d])
                      for d in devices},
        "by_phase": {ph: band([r["ratios"][ph] for r in ok if ph in r["ratios"]])
                     for ph in PHASES},
        "failed": [r["id"] for r in rows if not r.get("ratios")],
    }


# ---- planning -------------------------------------------------------------------------

def plan_run(run: PublicRun, index_dir: Path, time_limit_s: float) -> dict:
    """Plan one run with its device preset (no profile); its row of the record."""
    from planner.errors import PlanError
    from realign.run.loading import load_experiment
    from realign.run.plan_source import resolve_plan
    from realign.run.planning import plan_experiment, priced_with, resolve_models

    cfg = load_experiment(index_dir / run.experiment)
    cfg = priced_with(cfg, None)
    row = {"id": run.id, "system": run.system, "hardware": run.hardware,
           "experiment": run.experiment, "device": cfg.cluster.spec().device.name,
           "gpus": cfg.cluster.nodes * cfg.cluster.gpus_per_node,
           "measured": run.measured.model_dump()}
    try:
        if cfg.plan.manual:     # the run's own placement and micro-batches, priced
            plan = resolve_plan(cfg, resolve_models(cfg))
        else:
            plan = plan_experiment(cfg, {"time_limit_s": time_limit_s})
    except PlanError as e:
        return {**row, "error": str(e)}
    pj = json.loads(plan.to_json())
    calls = [{"mfc": a["mfc"], "kind": a["kind"], "time_s": a["time_s"],
              "engine": a.get("engine"), "mesh": a["mesh_name"],
              "layout": {k: a["layout"][k] for k in ("tp", "pp", "dp")},
              "micro_batches": a["micro_batches"]} for a in pj["allocations"]]
    phases = phase_estimates(pj)
    return {**row, "estimate": {"step_s": plan.iteration_time_s, "phases": phases,
                                "calls": calls,
                                "reallocations": [{"role": r["role"], "to": r["to_mfc"],
                                                   "time_s": r["time_s"]}
                                                  for r in pj["reallocations"]]},
            "search": {"method": plan.search.method, "time_s": plan.search.search_time_s},
            "ratios": compare(run.measured, plan.iteration_time_s, phases)}


def run_public(index: Path, only: str | None = None, time_limit_s: float = 30.0,
               progress=None) -> dict:
    idx = load_index(index)
    rows = []
    for run in select(idx, only):
        row = plan_run(run, index.parent, time_limit_s)
        rows.append(row)
        if progress:
            progress(row)
    return {
        "study": "public",
        "date": datetime.date.today().isoformat(),
        "index": str(index),
        "settings": {"time_limit_s": time_limit_s, "profile": None, "only": only},
        "environment": {"python": sys.version.split()[0], "platform": platform.platform(),
                        "cpu_count": os.cpu_count(),
                        "realign": __import__("realign").__version__,
                        "commit": _commit()},
        "runs": rows,
        "summary": summarize(rows),
    }


def _commit() -> str | None:
    """The git commit of the code that planned (None outside a git checkout); a checkout
    with uncommitted changes is marked ``+dirty``."""
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root,
                              capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "planner", "realign"],
                               cwd=root, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


# ---- what realign plan shows ----------------------------------------------------------

def summary_file(record: dict) -> dict:
    """The small summary ``realign plan`` reads (:func:`error_band_line`)."""
    s = record["summary"]
    return {"what": "estimate / measured step time of published RLHF runs, planned with "
                    "the device presets (no profile): realign bench public --summary",
            "date": record["date"], "n_runs": s["all"]["n_runs"] if s["all"] else 0,
            "all": s["all"], "by_device": s["by_device"]}


def error_band_line(device: str, path: Path | None = None) -> str | None:
    """The line ``realign plan`` prints for a plan priced with ``device``'s preset, read
    from the summary at ``path`` (default :data:`DEFAULT_SUMMARY`); None for the cpu
    device, which the set does not calibrate."""
    if device == "cpu":
        return None
    path = path or DEFAULT_SUMMARY
    if not path.is_file():
        return (f"GPU presets: no calibration summary at {path} "
                "(realign bench public --summary writes it)")
    s = json.loads(path.read_text())
    a = s.get("all")
    if not a:
        return "GPU presets: the calibration summary holds no runs"
    line = (f"GPU presets: median error {a['median_error_pct']:.0f} %, worst "
            f"{a['worst_error_pct']:.0f} % on {a['n_runs']} public runs")
    d = s.get("by_device", {}).get(device)
    if d:
        line += (f"; {device}: median error {d['median_error_pct']:.0f} %, worst "
                 f"{d['worst_error_pct']:.0f} % on {d['n_runs']} (estimate / measured "
                 f"median {d['median_ratio']:.2f}, worst {d['worst_ratio']:.2f})")
    else:
        line += f"; none on {device}"
    return line + f" [benchmarks/public_runs, {s.get('date', '?')}]"


# ---- text -----------------------------------------------------------------------------

def _fmt(x: float | None) -> str:
    return "-" if x is None else (f"{x:.0f}" if x >= 100 else f"{x:.1f}")


def line(r: dict) -> str:
    if "error" in r:
        return f"{r['id']:34s} {r['device']:9s} does not plan: {r['error']}"
    m, e, q = r["measured"], r["estimate"], r["ratios"]
    cells = [f"step {_fmt(e['step_s'])}/{_fmt(m['step_s'])} s = {q['step']:.2f}"]
    for ph in PHASES:
        if ph in q:
            cells.append(f"{ph} {_fmt(e['phases'][ph])}/{_fmt(m[f'{ph}_s'])} = {q[ph]:.2f}")
    return f"{r['id']:34s} {r['device']:9s} " + "  ".join(cells)


def _band_text(name: str, b: dict | None) -> str:
    if b is None:
        return f"  {name:12s} no runs"
    return (f"  {name:12s} n={b['n_runs']:2d}  median {b['median_ratio']:.2f} "
            f"(error {b['median_error_pct']:.0f} %)  worst {b['worst_ratio']:.2f} "
            f"(error {b['worst_error_pct']:.0f} %)")


def run(args: argparse.Namespace) -> int:
    if args.time_limit_s <= 0:
        raise UserError(f"must be > 0 (got {args.time_limit_s})", field="--time-limit")
    record = run_public(args.index, args.only, args.time_limit_s,
                        None if args.json else (lambda r: print(line(r), flush=True)))
    for path, obj in ((args.out, record),
                      (args.summary, summary_file(record) if args.summary else None)):
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(obj, indent=1) + "\n")
    if args.json:
        print(json.dumps(record, indent=1))
        return 0
    s = record["summary"]
    print("\nestimate / measured, step:")
    print(_band_text("all", s["all"]))
    for d, b in s["by_device"].items():
        print(_band_text(d, b))
    print("per phase (runs that published it):")
    for ph, b in s["by_phase"].items():
        print(_band_text(ph, b))
    if s["failed"]:
        print(f"did not plan: {', '.join(s['failed'])}")
    return 0
