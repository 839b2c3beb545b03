"""``realign run EXPERIMENT.yaml``: prepare the run (every check, then the plan: see
:func:`realign.run.prepare.prepare`), start the workers on this machine and train;
resumes from the run folder's last checkpoint. Bad input exits with code 2 before any
worker starts."""
from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("experiment", help="experiment YAML file")
    p.add_argument("--run-dir", help="run folder (overrides run.dir)")
    p.add_argument("--steps", type=int, help="override run.steps")


def run(args: argparse.Namespace) -> int:
    from planner.report import table
    from realign.controller.controller import Controller
    from realign.launch.local_launcher import LocalLauncher
    from realign.run.prepare import prepare

    spec = prepare(args.experiment, run_dir=args.run_dir, steps=args.steps)
    print(table(spec.plan))
    for r in spec.plan.reallocations:
        print(f"the plan reallocates {r.role} each step ({r.src_layout} -> {r.dst_layout})")
    print(f"run folder: {spec.run_dir}", flush=True)
    return Controller(spec, LocalLauncher.for_run(spec)).run()
