"""Does the searched plan depend on the search's seed? Plans every GPU experiment (and,
with ``--sweep``, every case of the plan sweep) once per seed and records, per setting,
the best and worst estimated iteration time over the seeds, their spread (worst / best
- 1) and the search times.

Each round plans every setting with every seed in turn (seeds interleaved, so a slow
spell of the machine hits each alike), in this process: the search time is what the
plan reports (pricing the candidates, the heuristics, the search), not Python's start,
and the process's CPU seconds per plan (the search runs on one thread, so on a busy
machine these stand for a quiet machine's wall time better than the wall clock does).

    python -m realign.bench.studies.plan_speed_seeds --seeds 0-7 --sweep \
        --out benchmarks/plan_speed/seeds_DATE.json

Settings: every ``experiments/*.yaml`` that plans for GPUs as written (but
``ppo-llama3-8b-16gpu.yaml``, which needs its checkpoints on disk), the 8B GRPO
long-tail experiment also padded with generation in waves (``train.packing: false``,
``rollout.refill: false``), and ``benchmarks/plan_sweep.yaml``'s cases. Time limits are
the experiments' own. Measure with nothing else running: on a 2-vCPU machine another
process moves the search times several-fold (the plans do not move: the walks stop on
steps, not on the clock, unless the time limit is reached).
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
from typing import Callable

import yaml

from realign.bench.studies.checkout import REPO

EXPERIMENTS = [
    "experiments/grpo-llama3.1-8b-16gpu-longtail.yaml",
    "experiments/grpo-llama3.1-8b-16gpu-longtail.yaml+padded-waves",
    "experiments/grpo-qwen2.5-7b-16gpu.yaml",
    "experiments/ppo-llama2-7b-8gpu.yaml",
    "experiments/ppo-llama2-70b-128gpu.yaml",
    "experiments/ppo-llama2-70b-1024gpu.yaml",
    "experiments/public/ppo-llama2-7b-8gpu.yaml",
    "experiments/public/ppo-llama2-13b-8gpu.yaml",
    "experiments/public/ppo-llama2-70b-16gpu.yaml",
    "experiments/public/ppo-llama2-70b-16gpu-lora.yaml",
    "experiments/public/ppo-llama2-70b-32gpu.yaml",
]
#: the variant suffix -> the YAML sections it overrides
VARIANTS = {"padded-waves": {"train": {"packing": False}, "rollout": {"refill": False}}}


def parse_seeds(text: str) -> list[int]:
    """``"0-7"`` -> [0..7]; ``"0,3,5"`` -> [0, 3, 5]."""
    if "-" in text:
        lo, hi = text.split("-")
        return list(range(int(lo), int(hi) + 1))
    return [int(x) for x in text.split(",")]


def experiment_planner(spec: str, tmp: Path, time_limit_s: float | None = None
                       ) -> Callable[[int], dict]:
    """A function seed -> one plan's numbers for experiment ``spec`` (a path, with
    ``+variant`` for one of :data:`VARIANTS`)."""
    from realign.run.loading import load_experiment
    from realign.run.planning import plan_experiment

    path, _, variant = spec.partition("+")
    cfg = load_experiment(REPO / path)          # its paths absolute: a variant keeps them
    if variant:
        doc = cfg.model_dump()
        for section, values in VARIANTS[variant].items():
            doc[section] = {**(doc.get(section) or {}), **values}
        cfg = type(cfg).model_validate(doc)

    def plan(seed: int) -> dict:
        t0 = time.process_time()
        p = plan_experiment(cfg, {"method": None, "time_limit_s": time_limit_s,
                                  "seed": seed})
        return {**numbers(p), "cpu_s": time.process_time() - t0}
    return plan


def sweep_planners(time_limit_s: float | None = None) -> dict[str, Callable[[int], dict]]:
    """seed -> numbers, for every case of ``benchmarks/plan_sweep.yaml``."""
    from planner.graph.algorithms import BatchShape, build_graph
    from planner.search.problem import RoleModel, head_of
    from planner.search.search import SearchSettings, search
    from planner.specs.cluster import ClusterSpec, resolve_device
    from planner.specs.model_spec import model_presets

    sweep = yaml.safe_load((REPO / "benchmarks" / "plan_sweep.yaml").read_text())
    presets, device, gpn = model_presets(), resolve_device(sweep["device"]), sweep["gpus_per_node"]
    algo = dict(sweep["algorithm"])
    name = algo.pop("name")
    out: dict[str, Callable[[int], dict]] = {}
    for actor, critic, n_gpus in sweep["cases"]:
        for gen in sweep["gen_lens"]:
            cluster = ClusterSpec(n_nodes=max(1, n_gpus // gpn), gpus_per_node=min(gpn, n_gpus),
                                  device=device)
            sizes = {"actor": actor, "ref": actor, "critic": critic, "reward": critic}
            graph = build_graph(name, BatchShape(gen_len=gen, **algo), set(sizes))
            models = {r: RoleModel(r, presets[m], head_of(r)) for r, m in sizes.items()}
            label = f"sweep {actor}+{critic}/{n_gpus}/{gen}"

            def plan(seed: int, graph=graph, models=models, cluster=cluster, label=label) -> dict:
                over = {"seed": seed} | ({"time_limit_s": time_limit_s} if time_limit_s else {})
                settings = SearchSettings(**{**sweep.get("plan", {}), **over})
                t0 = time.process_time()
                plan = search(label, graph, models, cluster, settings=settings)
                return {**numbers(plan), "cpu_s": time.process_time() - t0}
            out[label] = plan
    return out


def numbers(plan) -> dict:
    return {"iteration_time_s": plan.iteration_time_s,
            "search_time_s": plan.search.search_time_s, "steps": plan.search.steps,
            "converged": plan.search.converged, "method": plan.search.method,
            "megatron_s": next((h.iteration_time_s for h in plan.heuristics
                                if h.name == "megatron"), None)}


def summarise(runs: list[dict]) -> dict:
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"errors": len(runs)}
    est = [r["iteration_time_s"] for r in ok]
    st = [r["search_time_s"] for r in ok]
    cpu = [r["cpu_s"] for r in ok]
    meg = [r["megatron_s"] for r in ok if r["megatron_s"]]
    return {"best_s": min(est), "worst_s": max(est), "spread": max(est) / min(est) - 1,
            "search_time_s": {"median": statistics.median(st), "max": max(st)},
            "cpu_s": {"median": statistics.median(cpu), "max": max(cpu)},
            "megatron_s": meg[0] if meg else None,
            "converged": sum(r["converged"] for r in ok),
            "runs": len(ok), "errors": len(runs) - len(ok), "method": ok[0]["method"]}


def write(rec: dict, runs: dict[str, list[dict]], out: str | None) -> None:
    """Fill ``rec`` with the runs so far and their summaries; write it to ``out``."""
    rec["machine"]["loadavg_end"] = os.getloadavg()
    rec["runs"] = {k: v for k, v in runs.items() if v}
    rec["not_run"] = [k for k, v in runs.items() if not v]
    rec["summary"] = {k: summarise(v) for k, v in rec["runs"].items()}
    ok = [s for s in rec["summary"].values() if "spread" in s]
    rec["overall"] = {"settings": len(rec["summary"]),
                      "max_spread": max((s["spread"] for s in ok), default=None),
                      "within_1pct": sum(s["spread"] <= 0.01 for s in ok)}
    if out:
        Path(out).write_text(json.dumps(rec, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="0-7", help="seeds: 0-7 or 0,3,5 (default 0-7)")
    p.add_argument("--rounds", type=int, default=1, help="rounds over every setting and seed")
    p.add_argument("--sweep", action="store_true", help="also every case of the plan sweep")
    p.add_argument("--only", action="append", help="only settings whose name contains this "
                   "(repeatable; they run in the order given)")
    p.add_argument("--out", help="write the JSON record here")
    p.add_argument("--note", default="", help="what else ran on the machine")
    p.add_argument("--time-limit", type=float, dest="time_limit_s",
                   help="override every setting's plan.time_limit_s (a busy machine: the "
                   "walks then stop on their steps, not on the clock)")
    args = p.parse_args(argv)
    seeds = parse_seeds(args.seeds)
    from realign.bench.machine import describe

    rec: dict = {"date": time.strftime("%Y-%m-%d", time.gmtime()), "seeds": seeds,
                 "rounds": args.rounds, "note": args.note, "time_limit_s": args.time_limit_s,
                 "machine": {**describe(), "loadavg_start": os.getloadavg()}}
    with tempfile.TemporaryDirectory() as tmp:
        planners = {e: experiment_planner(e, Path(tmp), args.time_limit_s) for e in EXPERIMENTS}
        if args.sweep:
            planners.update(sweep_planners(args.time_limit_s))
        if args.only:
            planners = {k: v for o in args.only for k, v in planners.items() if o in k}
        runs: dict[str, list[dict]] = {k: [] for k in planners}
        for r in range(args.rounds):
            for name, plan in planners.items():
                for seed in seeds:
                    try:
                        res = {"round": r, "seed": seed, **plan(seed)}
                    except Exception as e:      # noqa: BLE001 -- recorded, the study goes on
                        res = {"round": r, "seed": seed, "error": f"{type(e).__name__}: {e}"}
                    runs[name].append(res)
                s = summarise(runs[name][-len(seeds):])
                print(f"round {r + 1} {name}: " + (
                    f"best {s['best_s']:.3f} s, worst {s['worst_s']:.3f} s, spread "
                    f"{100 * s['spread']:.2f} %, search max {s['search_time_s']['max']:.2f} s, "
                    f"CPU max {s['cpu_s']['max']:.2f} s"
                    if "best_s" in s else f"{s['errors']} errors"), flush=True)
                if args.out:        # after every setting: a stopped study keeps what it did
                    write(rec, runs, args.out)
    write(rec, runs, args.out)
    print(json.dumps(rec["overall"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
