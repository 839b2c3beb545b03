"""realign's own cost of a step outside its calls, measured by running realign: the
controller sends the step to every worker, each prepares the step's batch, walks the
program (which ops are its own, their records), reports its metrics and spans, and
the controller gathers every report, then logs and sends the next step. No probe of
the parts adds up to that (the parts overlap, and on few cores they compete with the
workers), so the profile runs it: a tiny SFT run whose one call is short, on one
worker and on all the profile's workers, and keeps per step its time minus the span
of its ops.

Each run's median is fitted as ``fixed_s + per_worker_s x workers`` (the controller
talks to every worker; two points, or one with a single worker). The batch the tiny
run prepares is timed on its own and taken out: the planner adds each experiment's
own (:mod:`realign.run.host_work`).
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import statistics
from pathlib import Path

from planner.cost.profile import StepCosts

#: steps of each run, and the first ones left out (start-up, first-call costs)
STEPS = 30
WARMUP = 5


def _experiment(folder: Path, workers: int, device: str, preset: str, threads: int,
                dtype: str) -> Path:
    """A tiny SFT experiment on ``workers`` devices (one train call, data-parallel)."""
    alloc = {"mesh": {"first_gpu": 0, "n_gpus": workers},
             "layout": {"tp": 1, "pp": 1, "dp": workers}}
    exp = {
        "name": f"profile-step-{workers}",
        "models": {"actor": str(folder / "tiny" / "actor")},
        "algorithm": {"name": "sft", "prompts_per_step": 8 * workers, "prompt_len": 8,
                      "gen_len": 4, "ppo_minibatches": 1},
        "data": {"train": {"path": str(folder / "tiny" / "sft.jsonl"), "kind": "sft",
                           "max_prompt_len": 8, "max_response_len": 4}},
        "train": {"lr": 1e-3},
        "cluster": {"nodes": 1, "gpus_per_node": workers, "device": preset},
        "device": device, "dtype": dtype,
        "plan": {"manual": {"actor.train": alloc}},
        "run": {"dir": str(folder / f"run{workers}"), "steps": STEPS,
                "checkpoint_interval": STEPS, "seed": 0},
        "launcher": {"type": "local", "threads_per_worker": threads},
    }
    path = folder / f"profile-step-{workers}.json"
    path.write_text(json.dumps(exp))
    return path


def outside_ops_s(run_dir: Path, warmup: int = WARMUP) -> list[float]:
    """Per step (after ``warmup``, the last left out: the final save follows it): its
    time minus the span from its first op's start to its last op's end."""
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()
            if ln.strip()]
    spans = {}
    for ln in (run_dir / "timeline.jsonl").read_text().splitlines():
        if ln.strip():
            t = json.loads(ln)
            spans[t["step"]] = (max(e[3] for e in t["events"])
                                - min(e[2] for e in t["events"]))
    return [max(0.0, r["step_time_s"] - spans[r["step"]]) for r in rows[warmup:-1]
            if r["step"] in spans]


def fit_step_costs(points: list[tuple[int, float]]) -> StepCosts:
    """``fixed_s + per_worker_s x workers`` through (workers, seconds) points: the line
    through the fewest and the most workers' (clipped at 0), or all fixed with one."""
    pts = sorted(points)
    (n0, t0), (n1, t1) = pts[0], pts[-1]
    per = max(0.0, (t1 - t0) / (n1 - n0)) if n1 > n0 else 0.0
    return StepCosts(fixed_s=max(0.0, t0 - per * n0), per_worker_s=per,
                     points=tuple((float(n), t) for n, t in pts))


def measure_step_costs(folder: Path, workers: int, device: str, preset: str, threads: int,
                       dtype: str) -> StepCosts:
    """Run the tiny SFT on 1 and on ``workers`` devices; the fitted step costs."""
    from realign.assets.tiny import make_tiny_assets
    from realign.controller.controller import Controller
    from realign.launch.local_launcher import LocalLauncher
    from realign.run.host_work import time_host_work
    from realign.run.prepare import prepare

    with contextlib.redirect_stderr(io.StringIO()):     # transformers' save progress bars
        make_tiny_assets(folder / "tiny", qwen2=False, small=False)
    points = []
    for n in sorted({1, workers}):
        exp = _experiment(folder, n, device, preset, threads, dtype)
        spec = prepare(exp)
        with open(os.devnull, "w") as quiet:
            if Controller(spec, LocalLauncher.for_run(spec), out=quiet).run() != 0:
                log = spec.run_dir / "logs"
                raise RuntimeError(f"the step-overhead run on {n} worker(s) failed; logs in "
                                   f"{log}")
        batch = time_host_work(spec.config)["batch_s"]
        points.append((n, max(0.0, statistics.median(outside_ops_s(spec.run_dir)) - batch)))
    return fit_step_costs(points)
