"""Summarise benchmarks/packing/interleaved.sh's runs: per mode and round, the median
(over steps after the first) of the step time, the train call's time and its padded
tokens, and the plan's estimates of each; then per mode the median and range over
rounds. Usage: python -m realign.bench.studies.packing_summarize OUT [RECORD.json]"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Callable

from realign.bench.plans import spread


def run_summary(folder: Path) -> dict:
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()
            if line.strip()]
    rows = [r for r in rows if "step_time_s" in r][1:]      # the first step warms up
    plan = json.loads((folder / "plan.json").read_text())
    est = {a["mfc"]: a["time_s"] for a in plan["allocations"]}

    def med(key: str) -> float:
        return statistics.median(r[key] for r in rows)
    return {"steps": len(rows), "step_time_s": med("step_time_s"),
            "train_s": med("time.actor.train"), "generate_s": med("time.actor.generate"),
            "padded_tokens": med("actor.padded_tokens"), "response_len": med("response_len"),
            "est_iteration_s": plan["iteration_time_s"], "est_train_s": est["actor.train"],
            "per_step": [{k: r[k] for k in ("step_time_s", "time.actor.train",
                                            "actor.padded_tokens", "response_len")}
                         for r in rows]}


def runs_by_mode(out: Path, modes: tuple[str, ...],
                 summarise: Callable[[Path], dict]) -> dict[str, list[dict]]:
    """mode -> the summaries of its rounds' folders ``OUT/<mode>-<round>/``, in name order
    (the layout benchmarks/packing/rounds.sh writes)."""
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for d in sorted(out.iterdir()):
        mode, _, rnd = d.name.partition("-")
        if d.is_dir() and mode in runs and rnd.isdigit():
            runs[mode].append(summarise(d))
    return runs


def spread_by_mode(runs: dict[str, list[dict]], keys: tuple[str, ...]) -> dict:
    """mode -> key -> the median, min and max over the mode's rounds; printed as a table."""
    summary: dict = {}
    for mode, rs in runs.items():
        summary[mode] = {k: spread([r[k] for r in rs]) for k in keys}
        for k, v in summary[mode].items():
            print(f"{mode:7s} {k:16s} median {v['median']:.4f}  range "
                  f"{v['min']:.4f} .. {v['max']:.4f}  ({len(rs)} rounds)")
    return summary


def main(out: Path, record: Path | None) -> None:
    runs = runs_by_mode(out, ("packed", "padded"), run_summary)
    summary = spread_by_mode(runs, ("step_time_s", "train_s", "generate_s", "padded_tokens",
                                    "response_len", "est_iteration_s", "est_train_s"))
    for k, est in (("train_s", "est_train_s"), ("step_time_s", "est_iteration_s")):
        meas = summary["padded"][k]["median"] / summary["packed"][k]["median"]
        planned = summary["padded"][est]["median"] / summary["packed"][est]["median"]
        print(f"speed-up {k}: measured {meas:.3f}x, planned {planned:.3f}x")
    if record is not None:
        record.write_text(json.dumps({"summary": summary, "runs": runs}, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]) if len(sys.argv) > 2 else None)
