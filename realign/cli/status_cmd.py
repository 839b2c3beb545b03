"""``realign status JOB``: the scheduler's state of a submitted job, its step and last
metrics (from the run folder's metrics.jsonl)."""
from __future__ import annotations

import argparse
import json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("job", help="job id printed by realign submit")
    p.add_argument("--json", action="store_true", help="one JSON object instead of text")


def run(args: argparse.Namespace) -> int:
    from realign.launch.backends import backend
    from realign.launch.jobs import find, format_status, progress

    job = find(args.job)
    state = backend(job.backend).status(job)
    if args.json:
        done, total, last = progress(job.run_dir)
        print(json.dumps({"job_id": job.job_id, "backend": job.backend, "state": state.state,
                          "detail": state.detail, "run_dir": job.run_dir, "step": done,
                          "steps": total, "last_metrics": last}))
    else:
        print(format_status(job, state))
    return 0
