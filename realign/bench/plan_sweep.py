"""``realign bench plan-sweep``: plan every case of a sweep and compare the searched
plan's estimated iteration time with each heuristic's.

Prints per case the searched and heuristic iteration times, the speed-up over the
Megatron-style symmetric plan and the search time, then the mean, min and max
speed-up. Records everything it ran under (sweep file, search settings, versions,
machine, thread counts) and the raw per-case numbers with ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import yaml

DEFAULT_SWEEP = Path(__file__).resolve().parents[2] / "benchmarks" / "plan_sweep.yaml"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sweep", default=str(DEFAULT_SWEEP), help="sweep definition (YAML)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--out", help="also write the JSON record here")
    p.add_argument("--limit", type=int, help="only the first N cases (smoke runs)")


def run_sweep(sweep: dict, limit: int | None = None, progress=None) -> dict:
    from planner.graph.algorithms import BatchShape, build_graph
    from planner.search.problem import RoleModel, head_of
    from planner.search.search import SearchSettings, search
    from planner.specs.cluster import ClusterSpec, resolve_device
    from planner.specs.model_spec import model_presets

    presets = model_presets()
    device = resolve_device(sweep["device"])
    gpn = sweep["gpus_per_node"]
    algo = dict(sweep["algorithm"])
    name = algo.pop("name")
    settings = SearchSettings(**sweep.get("plan", {}))
    rows = []
    cases = [(a, c, n, g) for a, c, n in sweep["cases"] for g in sweep["gen_lens"]]
    for actor, critic, n_gpus, gen in cases[:limit]:
        cluster = ClusterSpec(n_nodes=max(1, n_gpus // gpn), gpus_per_node=min(gpn, n_gpus),
                              device=device)
        shape = BatchShape(gen_len=gen, **algo)
        sizes = {"actor": actor, "ref": actor, "critic": critic, "reward": critic}
        graph = build_graph(name, shape, set(sizes))
        models = {r: RoleModel(r, presets[m], head_of(r)) for r, m in sizes.items()}
        t0 = time.perf_counter()
        plan = search(f"{actor}+{critic}/{n_gpus}/{gen}", graph, models, cluster,
                      settings=settings)
        wall = time.perf_counter() - t0
        heur = {h.name: h.iteration_time_s for h in plan.heuristics}
        row = {"actor": actor, "critic": critic, "gpus": n_gpus, "gen_len": gen,
               "iteration_time_s": plan.iteration_time_s, "heuristics": heur,
               "speedup_vs_megatron": (megatron_s / plan.iteration_time_s
                                       if (megatron_s := heur.get("megatron")) else None),
               "never_slower_than_heuristics": all(
                   t is None or plan.iteration_time_s <= t for t in heur.values()),
               "search_time_s": plan.search.search_time_s, "wall_s": wall,
               "method": plan.search.method, "steps": plan.search.steps,
               "allocations": {a.mfc: f"{a.mesh_name} {a.layout} x{a.micro_batches}"
                               for a in plan.allocations}}
        rows.append(row)
        if progress:
            progress(row)
    sp = [r["speedup_vs_megatron"] for r in rows if r["speedup_vs_megatron"]]
    return {
        "study": "plan-sweep",
        "sweep": sweep,
        "settings": settings.model_dump(),
        "environment": {
            "python": sys.version.split()[0], "platform": platform.platform(),
            "machine": platform.machine(), "cpu_count": os.cpu_count(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "realign": __import__("realign").__version__,
            "numpy": __import__("numpy").__version__,
            "pydantic": __import__("pydantic").__version__,
        },
        "cases": rows,
        "summary": {
            "n_cases": len(rows),
            "mean_speedup_vs_megatron": statistics.mean(sp) if sp else None,
            "min_speedup_vs_megatron": min(sp) if sp else None,
            "max_speedup_vs_megatron": max(sp) if sp else None,
            "never_slower_than_any_heuristic": all(r["never_slower_than_heuristics"] for r in rows),
            "max_search_time_s": max((r["search_time_s"] for r in rows), default=None),
        },
    }


def _line(r: dict) -> str:
    h = "  ".join(f"{k} {v:7.2f}" if v else f"{k}    n/a" for k, v in r["heuristics"].items())
    sp = f"x{r['speedup_vs_megatron']:.2f}" if r["speedup_vs_megatron"] else "  n/a"
    return (f"{r['actor']:>10s}+{r['critic']:<10s} {r['gpus']:4d} GPUs gen {r['gen_len']:4d}: "
            f"searched {r['iteration_time_s']:7.2f} s  {h}  {sp}  ({r['search_time_s']:.1f} s)")


def run(args: argparse.Namespace) -> int:
    from realign.errors import UserError
    p = Path(args.sweep)
    if not p.is_file():
        raise UserError(f"no sweep file at {args.sweep!r}", field="--sweep")
    sweep = yaml.safe_load(p.read_text())
    record = run_sweep(sweep, args.limit,
                       None if args.json else (lambda r: print(_line(r), flush=True)))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=1))
    if args.json:
        print(json.dumps(record, indent=1))
    else:
        s = record["summary"]
        print(f"\nspeed-up over megatron: mean {s['mean_speedup_vs_megatron']:.2f}x, "
              f"min {s['min_speedup_vs_megatron']:.2f}x, max {s['max_speedup_vs_megatron']:.2f}x; "
              f"never slower than any heuristic: {s['never_slower_than_any_heuristic']}; "
              f"slowest search {s['max_search_time_s']:.1f} s")
    return 0
