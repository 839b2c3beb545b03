"""``realign cancel JOB``: stop a job and its workers. Checkpoints are committed
atomically, so the last complete one stays usable: ``realign submit`` of the same run
folder resumes from it."""
from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("job", help="job id printed by realign submit")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from realign.launch.backends import backend
    from realign.launch.jobs import find
    from realign.run.checkpoint import latest

    job = find(args.job)
    state = backend(job.backend).cancel(job)
    print(f"job {job.job_id} ({job.backend}): {state.state}"
          + (f"  [{state.detail}]" if state.detail else ""))
    ckpt = latest(Path(job.run_dir))
    print(f"last checkpoint: {ckpt[1]} (step {ckpt[0]})" if ckpt else "no checkpoint yet")
    return 0
