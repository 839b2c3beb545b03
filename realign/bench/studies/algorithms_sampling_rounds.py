"""DAPO's dynamic sampling on a tiny task (default experiments/tiny-dapo-rounds-cpu.yaml,
30 steps): sampling again until the batch is full (the experiment's
``algorithm.params.max_sampling_rounds`` and ``max_round_prompts``, or ``--rounds``),
later rounds sized from the drop rate seen, against over-generating once
(``max_sampling_rounds: 1``), both with the experiment's first round
(``dropped_group_frac``), in interleaved repeats (A, B, A, B, ...) so that a change in
the machine's load touches both modes alike. Per run it keeps every step's sampling
metrics and step time, the plan's estimate (and the passes it priced the rollout at)
and the machine's load, and reports:

- the share of steps that trained a full batch (over-generation: no filler group,
  ``actor.shortfall_frac`` 0; rounds: ``actor.batch_full``);
- steps per second: steps over the sum of the steps' wall times (``step_time_s``; the
  start-up and the plan search are not in it);
- the rounds a step took (mean, max), the prompts its rounds generated for and the
  groups generated per group trained.

    python -m realign.bench.studies.algorithms_sampling_rounds --repeats 3 \
        --out benchmarks/algorithms/sampling_rounds_2026-11-28.json

``--experiment tiny-dapo-cpu --rounds 4`` measures the task that saturates (the share
of constant groups reaches 0.98-1.0 from step 21: no number of rounds fills those
steps). Every run uses fresh tiny assets in a temporary folder (offline), one run at
a time.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from realign.bench.studies.checkout import REPO

KEYS = ("step_time_s", "reward_mean", "time.actor.generate", "actor.sampling_rounds",
        "actor.batch_full", "actor.kept_groups", "actor.dropped_groups",
        "actor.round_prompts", "actor.dropped_frac_seen",
        "actor.dropped_group_frac", "actor.shortfall_frac", "actor.generated_per_trained")


def experiment(root: Path, name: str, rounds: int | None, label: str) -> Path:
    """The experiment next to the assets; ``rounds`` 1: over-generation once (no round
    cap); another number: that many rounds; None: the experiment's own."""
    cfg = yaml.safe_load((REPO / "experiments" / f"{name}.yaml").read_text())
    params = cfg["algorithm"].setdefault("params", {})
    if rounds == 1:
        params.pop("max_round_prompts", None)
    if rounds is not None:
        params["max_sampling_rounds"] = rounds
    cfg["data"]["train"]["path"] = str(root / "tiny" / "math_train.jsonl")
    cfg["models"] = {r: str(root / p) for r, p in cfg["models"].items()}
    cfg["reward"]["fn"] = str(root / "tiny_reward.py") + ":shaped"
    path = root / f"{label}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def run_one(root: Path, name: str, rounds: int | None, label: str) -> dict:
    exp = experiment(root, name, rounds, label)
    run_dir = root / "runs" / label
    r = subprocess.run([sys.executable, "-m", "realign.cli.main", "run", str(exp),
                        "--run-dir", str(run_dir)], capture_output=True, text=True, cwd=root)
    if r.returncode:
        raise SystemExit(f"{label}: exit {r.returncode}\n{r.stderr[-3000:]}")
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    plan = json.loads((run_dir / "plan.json").read_text())
    steps = [{k: row.get(k) for k in KEYS} for row in rows]
    full = [row["actor.batch_full"] == 1.0 if "actor.batch_full" in row
            else row["actor.shortfall_frac"] == 0.0 for row in rows]
    rounds_taken = [row.get("actor.sampling_rounds", 1.0) for row in rows]
    cfg = yaml.safe_load(exp.read_text())
    trained = cfg["algorithm"]["prompts_per_step"]
    prompts = [sum(row["actor.round_prompts"]) if "actor.round_prompts" in row
               else row["actor.generated_per_trained"] * trained for row in rows]
    wall = sum(row["step_time_s"] for row in rows)
    return {"label": label, "experiment": f"experiments/{name}.yaml",
            "max_sampling_rounds": cfg["algorithm"]["params"].get("max_sampling_rounds", 1),
            "max_round_prompts": cfg["algorithm"]["params"].get("max_round_prompts"),
            "steps": steps,
            "plan_iteration_s": plan["iteration_time_s"],
            "plan_generate_s": next(a["time_s"] for a in plan["allocations"]
                                    if a["mfc"] == "actor.generate"),
            "plan_generate_passes": next(m.get("sampling_rounds", 1.0)
                                         for m in plan["graph"]["mfcs"]
                                         if m["name"] == "actor.generate"),
            "summary": {"full_batch_share": sum(full) / len(full),
                        "steps_per_s": len(rows) / wall,
                        "rounds_mean": sum(rounds_taken) / len(rows),
                        "rounds_max": max(rounds_taken),
                        "prompts_per_step_mean": sum(prompts) / len(rows),
                        "generated_per_trained_mean": sum(
                            row["actor.generated_per_trained"] for row in rows) / len(rows)}}


def main() -> None:
    from realign.assets.tiny import make_tiny_assets
    from realign.bench.machine import describe, load_snapshot

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--experiment", default="tiny-dapo-rounds-cpu",
                    help="an experiments/ file name (without .yaml)")
    ap.add_argument("--rounds", type=int, default=None, help="max_sampling_rounds of the "
                    "resampling mode (default: the experiment's)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    record: dict = {"experiment": f"experiments/{args.experiment}.yaml",
                    "machine": describe(),
                    "load_before": load_snapshot(), "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        make_tiny_assets(root / "tiny", seed=0, qwen2=False)
        shutil.copy(REPO / "experiments" / "tiny_reward.py", root / "tiny_reward.py")
        for i in range(args.repeats):
            for rounds, mode in ((1, "overgen"), (args.rounds, "rounds")):
                res = run_one(root, args.experiment, rounds, f"{mode}_{i}")
                record["runs"].append(res)
                print(res["label"], json.dumps(res["summary"]), flush=True)
    record["load_after"] = load_snapshot()
    args.out.write_text(json.dumps(record, indent=1))
    for mode in ("overgen", "rounds"):
        mine = [r["summary"] for r in record["runs"] if r["label"].startswith(mode)]
        print(mode, "full-batch share", [round(s["full_batch_share"], 3) for s in mine],
              "steps/s", [round(s["steps_per_s"], 2) for s in mine])


if __name__ == "__main__":
    main()
