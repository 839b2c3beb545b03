"""How fast ``realign plan`` plans a large PPO, and what its search gains over the
heuristics, at 16, 128 and 1024 GPUs.

Each round runs ``realign plan EXP --out plan.json`` once per experiment, in turn
(rounds interleave the experiments, so a slow spell of the machine hits each alike),
and records the command's wall time (process start, planning, writing the plan), the
search time the plan reports, the searched plan's estimated iteration time, each
heuristic's (None: it does not fit), the annealing steps and whether every walk
converged. Prints the median and the spread (min-max) of every round, and writes one
JSON record with the machine it ran on.

    python -m realign.bench.studies.plan_speed_run --rounds 5 --out benchmarks/plan_speed/plan_speed_DATE.json

Measure with nothing else running: on a 2-vCPU machine another process moves the
wall time several-fold.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from realign.bench.plans import spread
from realign.bench.studies.checkout import REPO

EXPERIMENTS = ["experiments/public/ppo-llama2-70b-16gpu.yaml",
               "experiments/ppo-llama2-70b-128gpu.yaml",
               "experiments/ppo-llama2-70b-1024gpu.yaml"]


def plan_once(exp: str, workdir: Path) -> dict:
    """One ``realign plan`` of ``exp``: its wall time and what the plan says."""
    out = workdir / "plan.json"
    cmd = [sys.executable, "-m", "realign.cli.main", "plan", str(REPO / exp), "--out", str(out)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        return {"wall_s": wall, "error": proc.stderr[-2000:]}
    plan = json.loads(out.read_text())
    search = plan["search"]
    return {"wall_s": wall, "search_time_s": search["search_time_s"],
            "steps": search["steps"], "converged": search["converged"],
            "method": search["method"], "space_size": search["space_size"],
            "iteration_time_s": plan["iteration_time_s"],
            "heuristics": {h["name"]: h["iteration_time_s"] for h in plan["heuristics"]}}


def summarise(runs: list[dict]) -> dict:
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"errors": len(runs)}
    est = [r["iteration_time_s"] for r in ok]
    heur: dict[str, dict] = {}
    for name in ok[0]["heuristics"]:
        vals = [r["heuristics"][name] for r in ok]
        if any(v is None for v in vals):
            heur[name] = {"fits": False}
        else:
            gains = [v / e for v, e in zip(vals, est)]
            heur[name] = {"fits": True, "iteration_time_s": spread(vals), "gain": spread(gains)}
    return {"wall_s": spread([r["wall_s"] for r in ok]),
            "search_time_s": spread([r["search_time_s"] for r in ok]),
            "iteration_time_s": spread(est), "steps": spread([r["steps"] for r in ok]),
            "converged_rounds": sum(r["converged"] for r in ok), "rounds": len(ok),
            "errors": len(runs) - len(ok), "heuristics": heur}


def machine() -> dict:
    from realign.bench.machine import describe

    return {**describe(), "loadavg_start": os.getloadavg()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5, help="rounds over the experiments (default 5)")
    p.add_argument("--out", help="write the JSON record here")
    p.add_argument("experiments", nargs="*", default=EXPERIMENTS)
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    runs: dict[str, list[dict]] = {e: [] for e in args.experiments}
    rec = {"date": time.strftime("%Y-%m-%d", time.gmtime()), "machine": machine(),
           "rounds": args.rounds}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for e in args.experiments:
                res = plan_once(e, Path(tmp))
                runs[e].append(res)
                print(f"round {r + 1}/{args.rounds} {e}: "
                      + (f"error: {res['error'][-300:]}" if "error" in res else
                         f"wall {res['wall_s']:.2f} s, search {res['search_time_s']:.2f} s, "
                         f"{res['iteration_time_s']:.3f} s/iteration"), flush=True)
    rec["machine"]["loadavg_end"] = os.getloadavg()
    rec["runs"] = runs
    rec["summary"] = {e: summarise(rs) for e, rs in runs.items()}
    for e, s in rec["summary"].items():
        if "wall_s" not in s:
            print(f"{e}: every round failed")
            continue
        w, st, it = s["wall_s"], s["search_time_s"], s["iteration_time_s"]
        print(f"{e}: wall {w['median']:.2f} s ({w['min']:.2f}-{w['max']:.2f}), search "
              f"{st['median']:.2f} s ({st['min']:.2f}-{st['max']:.2f}), estimate "
              f"{it['median']:.3f} s ({it['min']:.3f}-{it['max']:.3f}), converged "
              f"{s['converged_rounds']}/{s['rounds']}")
        for name, h in s["heuristics"].items():
            print(f"    vs {name}: " + (f"{h['iteration_time_s']['median']:.3f} s, gain "
                                         f"{h['gain']['median']:.3f}x" if h["fits"]
                                         else "does not fit"))
    if args.out:
        Path(args.out).write_text(json.dumps(rec, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
