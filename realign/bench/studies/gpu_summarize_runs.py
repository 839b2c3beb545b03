"""Estimated against measured times of `realign run` folders (plan.json beside
metrics.jsonl), as `realign bench plans` summarizes a plan, plus what the analytic
device preset (no profile) estimates for the same allocations and, with ``--profile``,
what that profile table estimates. Prints one table per run (each call: estimated s,
measured median s, their ratio) and writes the numbers, the raw rows and the versions
it ran under to ``--out``. Used for the PPO runs on one H100 (benchmarks/gpu/README.md)
and the Qwen3-MoE GRPO of moe_grpo.sh:

    python -m realign.bench.studies.gpu_summarize_runs runs/gpu-ppo-medium runs/gpu-ppo-large \
        --out benchmarks/gpu/estimates_ppo_medium_large_h100_2026-11-24.json
"""
from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

from planner.cost.cost_model import CostModel
from planner.cost.profile import ProfileTable
from planner.plan import ExecutionPlan
from planner.search.problem import host_s
from realign.bench.machine import describe
from realign.bench.plans import summarize_plan


def priced(plan: ExecutionPlan, profile: ProfileTable | None) -> dict[str, float]:
    """Each allocation of ``plan`` priced again by the cost model with ``profile`` (None:
    the device preset alone), with the plan's cost settings and the allocation's own
    choices (offload, recompute, engine, token budget), as the search prices a call."""
    cm = CostModel(plan.cluster, plan.cost_config, profile)
    models = {pm.role: pm for pm in plan.models}
    out = {}
    for a in plan.allocations:
        m, pm = plan.graph.mfc(a.mfc), models[a.role]
        c = cm.mfc_cost(m, pm.spec, pm.head, a.mesh, a.layout, a.micro_batches,
                        a.optimizer_offload, a.train_state_offload, a.activation_recompute,
                        a.engine, pm.lora, a.token_budget)
        out[a.mfc] = c.time_s + host_s(plan.graph, m, plan.cost_config)
    return out


def versions() -> dict:
    """What the numbers were measured under: Python, torch, CUDA and the device."""
    import torch

    env = {**describe(), "host": platform.node()}
    if torch.cuda.is_available():
        env.update(cuda=torch.version.cuda, device=torch.cuda.get_device_name(0))
    return env


def ratio(est: float, meas: float | None) -> str:
    return f"{est / meas:6.2f}" if meas else "     -"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--profile", type=Path, default=None,
                    help="also price each call with this profile table")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    table = ProfileTable.load(args.profile) if args.profile else None
    record = {"study": "gpu estimates", "warmup": args.warmup, "versions": versions(),
              "profile": str(args.profile) if args.profile else None, "runs": []}
    for run in args.runs:
        text = (run / "plan.json").read_text()
        plan = json.loads(text)
        rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln]
        summary = summarize_plan(plan, [{"rows": rows}], args.warmup)
        parsed = ExecutionPlan.from_json(text)
        analytic = priced(parsed, None)
        profiled = priced(parsed, table) if table is not None else {}
        for m in summary["mfcs"]:
            m["analytic_estimated_s"] = analytic[m["mfc"]]
            if profiled:
                m["profile_estimated_s"] = profiled[m["mfc"]]
        record["runs"].append({"run": run.name, "profile": plan.get("profile"),
                               "models": {m["role"]: m["spec"] for m in plan["models"]},
                               "summary": summary, "raw": rows})
        meas_step = summary["measured_step"]["median"]
        print(f"{run.name}: {len(rows)} steps, {args.warmup} left out; iteration est "
              f"{summary['estimated_iteration_s']:.4f} s, measured median "
              f"{meas_step if meas_step is None else round(meas_step, 4)} s")
        head = (f"  {'call':22s} {'layout':>10s} {'est s':>9s} {'meas s':>9s} "
                f"{'min-max':>17s} {'est/meas':>8s}")
        if profiled:
            head += f" {'profile s':>9s} {'prof/meas':>9s}"
        print(head)
        for m in summary["mfcs"]:
            meas = m["measured"]
            lay = m["layout"]
            line = (f"  {m['mfc']:22s} {'%dx%dx%d' % (lay['tp'], lay['pp'], lay['dp']):>10s} "
                    f"{m['estimated_s']:9.4f} "
                    + (f"{meas['median']:9.4f} {meas['min']:8.4f}-{meas['max']:<8.4f}"
                       if meas["median"] is not None else f"{'-':>9s} {'-':>17s}")
                    + f" {ratio(m['estimated_s'], meas['median']):>8s}")
            if profiled:
                line += (f" {m['profile_estimated_s']:9.4f} "
                         f"{ratio(m['profile_estimated_s'], meas['median']):>9s}")
            print(line)
    args.out.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
