"""Summarise benchmarks/packing/refill_runs.sh's runs: per mode and round, the median
(over steps after the first) of the step time, the generate call's time and decode
steps, and the plan's estimates; then per mode the median and range over rounds, the
measured and planned speed-ups, and whether both modes sampled the same rollouts
(reward and response length equal at every step). Usage:
    python -m realign.bench.studies.packing_refill_summary OUT [RECORD.json]"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from realign.bench.studies.packing_summarize import runs_by_mode, spread_by_mode

KEYS = ("step_time_s", "generate_s", "decode_steps", "response_len", "est_iteration_s",
        "est_generate_s")


def run_summary(folder: Path) -> dict:
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()
            if line.strip()]
    rows = [r for r in rows if "step_time_s" in r]
    plan = json.loads((folder / "plan.json").read_text())
    est = {a["mfc"]: a["time_s"] for a in plan["allocations"]}
    timed = rows[1:]                                   # the first step warms up

    def med(key: str) -> float:
        return statistics.median(r[key] for r in timed)
    return {"steps": len(rows), "step_time_s": med("step_time_s"),
            "generate_s": med("time.actor.generate"),
            "decode_steps": med("decode_steps.actor.generate"),
            "response_len": med("response_len"),
            "est_iteration_s": plan["iteration_time_s"], "est_generate_s": est["actor.generate"],
            "per_step": [{k: r[k] for k in ("step_time_s", "time.actor.generate",
                                            "decode_steps.actor.generate", "response_len",
                                            "reward_mean")} for r in rows]}


def main(out: Path, record: Path | None) -> None:
    runs = runs_by_mode(out, ("refill", "waves"), run_summary)
    summary = spread_by_mode(runs, KEYS)
    for k, est in (("generate_s", "est_generate_s"), ("step_time_s", "est_iteration_s")):
        meas = summary["waves"][k]["median"] / summary["refill"][k]["median"]
        planned = summary["waves"][est]["median"] / summary["refill"][est]["median"]
        summary[f"speedup_{k}"] = {"measured": meas, "planned": planned}
        print(f"speed-up {k}: measured {meas:.3f}x, planned {planned:.3f}x")
    same = all(a["reward_mean"] == b["reward_mean"] and a["response_len"] == b["response_len"]
               for ra, rb in zip(runs["refill"], runs["waves"])
               for a, b in zip(ra["per_step"], rb["per_step"]))
    summary["same_rollouts"] = same
    print(f"same rewards and response lengths at every step in both modes: {same}")
    if record is not None:
        record.write_text(json.dumps({"summary": summary, "runs": runs}, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]) if len(sys.argv) > 2 else None)
