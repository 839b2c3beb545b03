"""``realign bench plans EXPERIMENT.yaml``: run several distinct plans of one experiment
on this machine and hold every estimate against its measurement.

1. The profile: ``--profile FILE``, or ``realign profile`` runs first (its table is kept
   in the result folder). Every plan is priced with it.
2. The plans (:func:`planner.search.variants.bench_plans`): the searched plan, every heuristic
   that fits, and hand-made variants (mesh splits, TP/PP/DP, micro-batches), ``--plans``
   of them, all distinct.
3. Each round runs every plan once (rounds alternate the plans, so a slow spell of the
   machine touches all of them): ``realign run`` of that saved plan for ``--warmup`` +
   ``--steps`` steps; the warm-up steps are left out of every number.
4. Per plan and MFC: the estimated time and the measured median over every kept step
   of every round, with the spread (the per-round medians' min and max); per plan the
   same of the iteration (step) time; the Kendall tau between the plans' estimated
   and measured iteration times. Nothing is dropped: every raw step is in the JSON.

``--out`` writes the JSON, ``--svg`` the picture (:mod:`realign.bench.plans_svg`).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from realign.errors import UserError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("experiment", type=Path, help="experiment YAML")
    p.add_argument("--plans", type=int, default=8, help="distinct plans to run (default 8)")
    p.add_argument("--steps", type=int, default=6,
                   help="measured steps per plan and round, after the warm-up (default 6)")
    p.add_argument("--warmup", type=int, default=2,
                   help="steps run first and left out (default 2)")
    p.add_argument("--rounds", type=int, default=3, help="rounds over all plans (default 3)")
    p.add_argument("--profile", type=Path, default=None,
                   help="profile table to price with (default: run realign profile first)")
    p.add_argument("--analytic", action="store_true",
                   help="price with the analytic device preset only, no profile (to compare)")
    p.add_argument("--out", type=Path, default=None, help="write the JSON here")
    p.add_argument("--svg", type=Path, default=None, help="write the picture here")
    p.add_argument("--json", action="store_true", help="print the JSON instead of the table")


# ---- statistics (pure) ---------------------------------------------------------------

def kendall_tau(xs: list[float], ys: list[float]) -> float | None:
    """Kendall's tau-b between two paired samples (ties counted as in tau-b); None for
    fewer than two pairs or a constant sample."""
    n = len(xs)
    conc = disc = tx = ty = 0
    for i in range(n):
        for j in range(i + 1, n):
            dx, dy = xs[i] - xs[j], ys[i] - ys[j]
            if dx == 0 and dy == 0:
                continue
            if dx == 0:
                tx += 1
            elif dy == 0:
                ty += 1
            elif (dx > 0) == (dy > 0):
                conc += 1
            else:
                disc += 1
    denom = ((conc + disc + tx) * (conc + disc + ty)) ** 0.5
    return (conc - disc) / denom if denom > 0 else None


def spread(values: list[float]) -> dict:
    """Median, min, max and count of ``values`` (None entries dropped)."""
    v = [x for x in values if x is not None]
    if not v:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v)}


def summarize_plan(plan: dict, runs: list[dict], warmup: int) -> dict:
    """Estimated and measured times of one plan over its rounds (pure). ``plan``: the
    plan JSON; ``runs``: per round ``{"rows": metrics.jsonl rows}`` or ``{"error":
    ...}``."""
    ok = [r for r in runs if "rows" in r]
    kept = [r["rows"][warmup:] for r in ok]
    mfcs = []
    for a in plan["allocations"]:
        key = f"time.{a['mfc']}"
        steps = [row[key] for rows in kept for row in rows if key in row]
        rounds = [statistics.median([row[key] for row in rows if key in row])
                  for rows in kept if any(key in row for row in rows)]
        meas = spread(steps)
        mfcs.append({"mfc": a["mfc"], "layout": a["layout"], "mesh": a["mesh_name"],
                     "micro_batches": a["micro_batches"], "estimated_s": a["time_s"],
                     "measured": meas, "round_medians": rounds,
                     "spread_of_rounds": spread(rounds),
                     "relative_error": (abs(a["time_s"] - meas["median"]) / meas["median"]
                                        if meas["median"] is not None and meas["median"] > 0 else None)})
    reallocs = []
    for r in plan["reallocations"]:
        key = f"time.realloc.{r['to_mfc']}"
        steps = [row[key] for rows in kept for row in rows if key in row]
        meas = spread(steps)
        reallocs.append({"role": r["role"], "to_mfc": r["to_mfc"], "bytes": r["bytes"],
                         "estimated_s": r["time_s"], "measured": meas,
                         "relative_error": (abs(r["time_s"] - meas["median"]) / meas["median"]
                                            if meas["median"] is not None and meas["median"] > 0 else None)})
    steps = [row["step_time_s"] for rows in kept for row in rows]
    rounds = [statistics.median([row["step_time_s"] for row in rows]) for rows in kept if rows]
    return {"estimated_iteration_s": plan["iteration_time_s"], "measured_step": spread(steps),
            "step_round_medians": rounds, "step_spread_of_rounds": spread(rounds),
            "mfcs": mfcs, "reallocations": reallocs,
            "errors": [r["error"] for r in runs if "error" in r]}


def summarize(plans: list[dict]) -> dict:
    """Accuracy over every plan: per-MFC relative errors, Kendall tau of the iteration
    times, and whether the searched plan is the fastest measured (or within the spread
    of the fastest: its fastest round no slower than the fastest plan's slowest)."""
    errs = [m["relative_error"] for p in plans for m in p["summary"]["mfcs"]
            if m["relative_error"] is not None]
    est = [p["summary"]["estimated_iteration_s"] for p in plans
           if p["summary"]["measured_step"]["median"] is not None]
    meas = [p["summary"]["measured_step"]["median"] for p in plans
            if p["summary"]["measured_step"]["median"] is not None]
    ran = [p for p in plans if p["summary"]["measured_step"]["median"] is not None]
    fastest = min(ran, key=lambda p: p["summary"]["measured_step"]["median"]) if ran else None
    searched = next((p for p in ran if p["origin"] == "searched"), None)
    within = None
    if searched and fastest:
        sp_s, sp_f = (searched["summary"]["step_spread_of_rounds"],
                      fastest["summary"]["step_spread_of_rounds"])
        within = searched is fastest or sp_s["min"] <= sp_f["max"]
    return {
        "mfc_relative_error": {"median": statistics.median(errs) if errs else None,
                               "worst": max(errs) if errs else None, "n": len(errs)},
        "kendall_tau_iteration": kendall_tau(est, meas),
        "fastest_measured": fastest["label"] if fastest else None,
        "searched_is_fastest_or_within_spread": within,
    }


# ---- running -------------------------------------------------------------------------

def run_plan(experiment: Path, plan_path: Path, run_dir: Path, steps: int,
             transform=None) -> dict:
    """``realign run`` of a saved plan; ``{"rows": metrics rows, "timeline": its
    timeline.jsonl records}`` or ``{"error": ...}`` (``transform``:
    :func:`realign.run.prepare.prepare`'s)."""
    from realign.controller.controller import Controller
    from realign.launch.local_launcher import LocalLauncher
    from realign.run.prepare import prepare

    spec = prepare(experiment, run_dir=str(run_dir), steps=steps, plan_file=plan_path,
                   transform=transform)
    with open(os.devnull, "w") as quiet:
        code = Controller(spec, LocalLauncher.for_run(spec), out=quiet).run()
    if code != 0:
        return {"error": f"exit {code}; logs in {run_dir / 'logs'}"}
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()
            if ln.strip()]
    tl = run_dir / "timeline.jsonl"
    timeline = ([json.loads(ln) for ln in tl.read_text().splitlines() if ln.strip()]
                if tl.exists() else [])
    return {"rows": rows, "timeline": timeline}


def _profile(args, cfg, folder: Path):
    """The profile every plan is priced with: ``--profile`` (checked against the
    experiment like ``plan.profile``), none with ``--analytic``, else a fresh one."""
    from realign.run.planning import load_profile, with_profile
    if args.analytic:
        if args.profile is not None:
            raise UserError("give --profile or --analytic, not both", field="--analytic")
        return None, "none (analytic device preset)"
    if args.profile is not None:
        return load_profile(with_profile(cfg, args.profile)), str(args.profile)
    from realign.profile.run import default_settings, profile_machine
    out = folder / "profile.json"
    preset = cfg.cluster.spec().device.name if cfg.device == "cuda" else None
    table = profile_machine(default_settings(cfg.device, None, 1, cfg.run_dtype(), preset),
                            out=sys.stderr)
    out.write_text(table.model_dump_json(indent=1))
    return table, str(out)


def run(args: argparse.Namespace) -> int:
    for name in ("plans", "steps", "rounds"):
        if getattr(args, name) < 1:
            raise UserError(f"must be >= 1, got {getattr(args, name)}", field=f"--{name}")
    if args.warmup < 0:
        raise UserError(f"must be >= 0, got {args.warmup}", field="--warmup")
    from planner.search.variants import bench_plans
    from realign.run.loading import load_experiment
    from realign.run.planning import (
        cost_config,
        experiment_graph,
        priced_with,
        resolve_models,
        search_settings,
    )

    cfg = load_experiment(args.experiment)
    if cfg.launcher.type != "local":
        raise UserError("realign bench plans runs on this machine: launcher local, not "
                        f"{cfg.launcher.type!r}", field="launcher.type")
    if cfg.device == "cuda":
        import torch
        have, need = torch.cuda.device_count(), cfg.cluster.spec().n_gpus
        if have < need:
            raise UserError(f"realign bench plans runs on this machine: the experiment's "
                            f"cluster has {need} GPU(s), this machine {have} CUDA device(s); "
                            "shrink the cluster or run it where the GPUs are", field="cluster")
    t0 = time.time()
    keep = Path(tempfile.mkdtemp(prefix="realign-bench-plans-"))
    profile, profile_src = _profile(args, cfg, keep)
    models = resolve_models(cfg)
    graph = experiment_graph(cfg, models)
    plans = bench_plans(cfg.name, graph, models, cfg.cluster.spec(),
                        cost_config(priced_with(cfg, profile_src if profile else None),
                                    host_work=True),
                        profile, search_settings(cfg), n=args.plans)
    entries = []
    for k, lp in enumerate(plans):
        path = keep / f"plan{k}.json"
        path.write_text(lp.plan.to_json())
        entries.append({"label": lp.label, "origin": lp.origin, "path": path,
                        "plan": json.loads(lp.plan.to_json()), "runs": []})
    print(f"bench plans: {len(entries)} plans x {args.rounds} rounds x "
          f"({args.warmup} + {args.steps}) steps; profile {profile_src}", file=sys.stderr)
    for r in range(args.rounds):
        for k, e in enumerate(entries):
            print(f"  round {r + 1}/{args.rounds}, plan {k + 1}/{len(entries)}: {e['label']}",
                  file=sys.stderr, flush=True)
            with tempfile.TemporaryDirectory(prefix="realign-bench-plan-") as tmp:
                e["runs"].append(run_plan(args.experiment, e["path"], Path(tmp) / "run",
                                          args.warmup + args.steps))
    results = []
    for e in entries:
        results.append({"label": e["label"], "origin": e["origin"],
                        "allocations": {a["mfc"]: f"{a['mesh_name']} TP{a['layout']['tp']}"
                                        f"·PP{a['layout']['pp']}·DP{a['layout']['dp']} "
                                        f"x{a['micro_batches']}"
                                        for a in e["plan"]["allocations"]},
                        "summary": summarize_plan(e["plan"], e["runs"], args.warmup),
                        "raw": e["runs"], "plan": e["plan"]})
    record = {
        "study": "plans", "experiment": str(args.experiment),
        "config": {"plans": args.plans, "steps": args.steps, "warmup": args.warmup,
                   "rounds": args.rounds, "profile": profile_src,
                   "experiment": cfg.model_dump(mode="json")},
        "profile": profile.model_dump(mode="json") if profile is not None else None,
        "environment": _environment(), "plans": results, "summary": summarize(results),
        "wall_s": time.time() - t0,
    }
    from realign.bench.plans_svg import render
    emit(args, record, render, table)
    return 0


def emit(args: argparse.Namespace, record: dict, render, table) -> None:
    """A study's record: the JSON to ``--out``, ``render(record)`` to ``--svg``, and
    ``table(record)`` (or the JSON with ``--json``) to stdout."""
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1) + "\n")
    if args.svg:
        args.svg.parent.mkdir(parents=True, exist_ok=True)
        args.svg.write_text(render(record))
    print(json.dumps(record, indent=1) if args.json else table(record))


def _environment() -> dict:
    import platform

    from realign.bench.machine import environment, load_snapshot
    return {**environment(), "load_at_end": load_snapshot(), "platform": platform.platform()}


def _f(v, fmt: str) -> str:
    """``v`` formatted, or "n/a" for None."""
    return "n/a" if v is None else format(v, fmt)


def table(rec: dict) -> str:
    """The result as text: per plan its MFCs (estimated, measured median and spread) and
    its iteration, then the accuracy summary."""
    lines = [f"bench plans: {rec['experiment']} ({rec['config']['rounds']} rounds x "
             f"{rec['config']['steps']} steps after {rec['config']['warmup']} warm-up; "
             f"profile {rec['config']['profile']})"]
    for p in rec["plans"]:
        s = p["summary"]
        st = s["measured_step"]
        sr = s["step_spread_of_rounds"]
        if st["median"] is None:
            why = "; ".join(s["errors"]) or "no measured steps"
            lines.append(f"\n{p['label']}: did not run ({why})")
            continue
        lines.append(f"\n{p['label']}: iteration est {s['estimated_iteration_s']:.4f} s, "
                     f"measured {st['median']:.4f} s (rounds {sr['min']:.4f}-{sr['max']:.4f})")
        for m in s["mfcs"]:
            me = m["measured"]
            sp = m["spread_of_rounds"]
            lines.append(f"  {m['mfc']:22} {p['allocations'][m['mfc']]:28} est "
                         f"{m['estimated_s']:.4f}  meas {_f(me['median'], '.4f')} "
                         f"({_f(sp['min'], '.4f')}-{_f(sp['max'], '.4f')})"
                         f"  err {_f(m['relative_error'], '.0%')}")
        for r in s["reallocations"]:
            if r["measured"]["median"] is not None:
                lines.append(f"  realloc {r['role']} -> {r['to_mfc']:12} est "
                             f"{r['estimated_s']:.4f}  meas {r['measured']['median']:.4f}"
                             f"  err {_f(r['relative_error'], '.0%')}")
    s = rec["summary"]
    e = s["mfc_relative_error"]
    tau = s["kendall_tau_iteration"]
    lines.append(f"\nper-MFC |est - meas| / meas over {e['n']} MFCs: median "
                 f"{_f(e['median'], '.1%')}, worst {_f(e['worst'], '.1%')}")
    lines.append(f"Kendall tau (estimated vs measured iteration): "
                 f"{'n/a' if tau is None else f'{tau:.3f}'}")
    lines.append(f"fastest measured: {s['fastest_measured']}; searched plan fastest or within "
                 f"its spread: {s['searched_is_fastest_or_within_spread']}")
    return "\n".join(lines)
