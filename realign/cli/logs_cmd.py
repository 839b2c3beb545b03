"""``realign logs JOB [--follow]``: the controller's and the workers' logs of a job
(``RUN/logs``); ``--follow`` streams them until the job ends."""
from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("job", help="job id printed by realign submit")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing until the job ends")


def run(args: argparse.Namespace) -> int:
    from realign.launch.backends import backend
    from realign.launch.jobs import find, print_logs

    job = find(args.job)
    b = backend(job.backend)
    print_logs(lambda: b.log_files(job), lambda: b.status(job), args.follow)
    return 0
