"""Estimated against measured times of `realign run` folders (plan.json beside
metrics.jsonl), as `realign bench plans` summarizes a plan, plus what the analytic
device preset (no profile) estimates for the same allocations. Used for the PPO runs
on one H100 (benchmarks/gpu/README.md):

    python benchmarks/gpu/summarize_runs.py runs/gpu-ppo-medium runs/gpu-ppo-large \
        --out benchmarks/gpu/estimates_ppo_medium_large_h100_2026-11-24.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from planner.cost.cost_model import CostModel
from planner.plan import ExecutionPlan
from realign.bench.plans import summarize_plan


def analytic_estimates(plan: ExecutionPlan) -> dict[str, float]:
    """Each allocation priced by the device preset alone (the plan's cost settings)."""
    cm = CostModel(plan.cluster, plan.cost_config, None)
    models = {pm.role: pm for pm in plan.models}
    return {a.mfc: cm.mfc_cost(plan.graph.mfc(a.mfc), models[a.role].spec, models[a.role].head,
                               a.mesh, a.layout, a.micro_batches, a.optimizer_offload).time_s
            for a in plan.allocations}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    record = {"study": "gpu estimates", "warmup": args.warmup, "runs": []}
    for run in args.runs:
        text = (run / "plan.json").read_text()
        plan = json.loads(text)
        rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln]
        summary = summarize_plan(plan, [{"rows": rows}], args.warmup)
        analytic = analytic_estimates(ExecutionPlan.from_json(text))
        for m in summary["mfcs"]:
            m["analytic_estimated_s"] = analytic[m["mfc"]]
        record["runs"].append({"run": run.name, "profile": plan.get("profile"),
                               "models": {m["role"]: m["spec"] for m in plan["models"]},
                               "summary": summary, "raw": rows})
        print(f"{run.name}: iteration est {summary['estimated_iteration_s']:.4f} s, measured "
              f"median {summary['measured_step']['median']:.4f} s")
        for m in summary["mfcs"]:
            meas = m["measured"]
            print(f"  {m['mfc']:18s} est {m['estimated_s']:.4f} (analytic preset "
                  f"{m['analytic_estimated_s']:.4f})  meas {meas['median']:.4f} "
                  f"({meas['min']:.4f}-{meas['max']:.4f})  err {100 * m['relative_error']:.0f}%")
    args.out.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
