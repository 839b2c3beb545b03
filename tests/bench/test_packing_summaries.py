"""The packing study's summaries (realign/bench/studies/packing_summarize.py and
packing_refill_summary.py) over run folders laid out as benchmarks/packing/rounds.sh
writes them, ``OUT/<mode>-<round>/{metrics.jsonl,plan.json}``: the rounds of each mode
found and nothing else, each run's medians over its steps after the first, and per mode
the median, min and max over rounds."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from realign.bench.studies import packing_refill_summary, packing_summarize

pytestmark = pytest.mark.pure


def write_run(folder: Path, step_s: list[float], generate_s: float, estimate_s: float,
              reward: float = 0.5) -> None:
    """A run folder: one metrics row per step (the first a slow warm-up) and a plan."""
    folder.mkdir(parents=True)
    rows = [{"step": i, "step_time_s": s, "time.actor.train": s / 2,
             "time.actor.generate": generate_s, "actor.padded_tokens": 100.0 + i,
             "response_len": 3.0, "decode_steps.actor.generate": 4.0 + i,
             "reward_mean": reward} for i, s in enumerate(step_s)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    plan = {"iteration_time_s": estimate_s,
            "allocations": [{"mfc": "actor.train", "time_s": estimate_s / 2},
                            {"mfc": "actor.generate", "time_s": estimate_s / 4}]}
    (folder / "plan.json").write_text(json.dumps(plan))


def test_rounds_of_each_mode_and_their_spread(tmp_path: Path) -> None:
    write_run(tmp_path / "packed-1", [9.0, 1.0, 3.0], 0.5, 2.0)
    write_run(tmp_path / "packed-2", [9.0, 2.0, 2.0], 0.5, 2.0)
    write_run(tmp_path / "padded-1", [9.0, 4.0, 4.0], 0.5, 3.0)
    write_run(tmp_path / "padded-x", [9.0, 8.0, 8.0], 0.5, 3.0)     # not a round
    write_run(tmp_path / "other-1", [9.0, 8.0, 8.0], 0.5, 3.0)      # not a mode
    (tmp_path / "load.txt").write_text("load average: 1.0\n")
    runs = packing_summarize.runs_by_mode(tmp_path, ("packed", "padded"),
                                          packing_summarize.run_summary)
    assert [len(runs["packed"]), len(runs["padded"])] == [2, 1]
    # a run's medians leave its first (warm-up) step out
    assert [r["step_time_s"] for r in runs["packed"]] == [2.0, 2.0]
    assert runs["padded"][0]["padded_tokens"] == 101.5
    summary = packing_summarize.spread_by_mode(runs, ("step_time_s", "est_iteration_s"))
    assert summary["packed"]["step_time_s"] == {"median": 2.0, "min": 2.0, "max": 2.0, "n": 2}
    assert summary["padded"]["est_iteration_s"]["median"] == 3.0


def test_refill_summary_record(tmp_path: Path) -> None:
    out = tmp_path / "runs"
    write_run(out / "refill-1", [9.0, 1.0, 1.0], 0.5, 2.0)
    write_run(out / "waves-1", [9.0, 2.0, 2.0], 1.0, 3.0)
    write_run(out / "refill-2", [9.0, 1.0, 3.0], 0.5, 2.0)
    write_run(out / "waves-2", [9.0, 4.0, 4.0], 1.0, 3.0)
    record = tmp_path / "record.json"
    packing_refill_summary.main(out, record)
    summary = json.loads(record.read_text())["summary"]
    assert summary["refill"]["step_time_s"] == {"median": 1.5, "min": 1.0, "max": 2.0, "n": 2}
    assert summary["speedup_step_time_s"] == {"measured": 3.0 / 1.5, "planned": 1.5}
    assert summary["speedup_generate_s"]["measured"] == 2.0
    assert summary["same_rollouts"] is True
    write_run(out / "waves-3", [9.0, 4.0, 4.0], 1.0, 3.0)
    write_run(out / "refill-3", [9.0, 1.0, 1.0], 0.5, 2.0, reward=0.25)    # other rollouts
    packing_refill_summary.main(out, record)
    assert json.loads(record.read_text())["summary"]["same_rollouts"] is False
