"""``realign plan EXPERIMENT.yaml``: search an execution plan and report it.

Prints a table (one row per MFC, the estimated iteration time, the heuristics and
the speed-up over each, the search time), or with ``--json`` one JSON object. A plan
priced with a GPU device preset (no profile) also gets the error band of those presets
on published runs (``benchmarks/public_runs/summary.json``, written by ``realign bench
public --summary``; read here, never recomputed).
``--out`` writes the full plan (what ``realign run`` executes), ``--timeline`` an
SVG picture. Never imports torch.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from realign.errors import UserError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("experiment", help="experiment YAML file")
    p.add_argument("--out", help="write the execution plan (JSON) here")
    p.add_argument("--timeline", help="write a timeline picture (SVG) here")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--method", choices=["auto", "exact", "anneal"], help="override plan.method")
    p.add_argument("--time-limit", type=float, dest="time_limit_s", help="override plan.time_limit_s")
    p.add_argument("--seed", type=int, help="override plan.seed")
    p.add_argument("--profile", help="price with this profile table (realign profile's "
                   "output); overrides plan.profile")


def _write(path: str, text: str) -> None:
    """Write atomically: a failed write leaves any previous file intact."""
    p = Path(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(p.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(p)
    except OSError as e:
        raise UserError(f"cannot write {path}: {e.strerror}", field="--out") from None


def run(args: argparse.Namespace) -> int:
    from planner.report import summary, table
    from planner.timeline_svg import render
    from realign.bench.public import error_band_line
    from realign.run.loading import load_experiment
    from realign.run.planning import plan_experiment, with_profile

    if args.time_limit_s is not None and args.time_limit_s <= 0:
        raise UserError(f"must be > 0 (got {args.time_limit_s})", field="--time-limit")
    if args.seed is not None and args.seed < 0:
        raise UserError(f"must be >= 0 (got {args.seed})", field="--seed")
    cfg = load_experiment(args.experiment)
    if args.profile:
        cfg = with_profile(cfg, args.profile)
    plan = plan_experiment(cfg, {"method": args.method, "time_limit_s": args.time_limit_s,
                                 "seed": args.seed})
    if args.out:
        _write(args.out, plan.to_json())
    if args.timeline:
        _write(args.timeline, render(plan))
    band = None if plan.profile is not None else error_band_line(plan.cluster.device.name)
    if args.json:
        print(json.dumps({**summary(plan), "calibration": band}, indent=1))
    else:
        print(table(plan))
        if band:
            print(band)
        if args.out:
            print(f"plan written to {args.out}")
        if args.timeline:
            print(f"timeline written to {args.timeline}")
    return 0
