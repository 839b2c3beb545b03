"""``realign submit EXPERIMENT.yaml``: prepare the run folder and hand it to a scheduler
(Slurm, Ray, or a detached process here); prints the job id and the run folder.

The back end is the YAML's ``launcher.type`` unless ``--launcher`` overrides it (its
options then take their defaults). The job is recorded in the job index, so
``realign status|logs|cancel JOB`` find it from anywhere.
"""
from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("experiment", help="experiment YAML file")
    p.add_argument("--launcher", help="back end (slurm | ray | local); default: the YAML's "
                                      "launcher.type")
    p.add_argument("--dry-run", action="store_true",
                   help="prepare the run folder and print what would be submitted; submit nothing")
    p.add_argument("--run-dir", help="run folder (overrides run.dir)")
    p.add_argument("--steps", type=int, help="override run.steps")


def run(args: argparse.Namespace) -> int:
    from realign.launch.backends import backend
    from realign.launch.jobs import remember
    from realign.run.loading import load_experiment

    name = args.launcher or load_experiment(args.experiment).launcher.type
    args.launcher = name
    b = backend(name)
    if not args.dry_run:
        b.check_available()
    job = b.submit(args)
    if job is None:
        return 0
    remember(job)
    print(f"submitted job {job.job_id} ({job.backend})")
    print(f"run folder: {job.run_dir}", flush=True)
    return 0
