"""Ray jobs: ``realign submit --launcher ray`` prepares the run folder and submits a Ray
job whose entrypoint is the controller (``python -m realign.controller.main RUN
--launcher ray``): the controller is the job's driver and its workers are actors
(:class:`realign.launch.ray_launcher.RayLauncher`). ``status``/``logs``/``cancel`` ask
the cluster's job API (the dashboard, ``http://HEAD:8265``).

The address is the experiment's ``launcher.address``: ``http://HEAD:8265`` (the job
API), a GCS ``host:port``, or ``auto`` (``RAY_ADDRESS``, else the cluster started on
this machine). The run folder must be readable at the same path on the cluster (a
shared file system, as under Slurm), and ``python`` on the cluster must import realign.
A cluster that does not answer is a UserError within :data:`CONNECT_DEADLINE_S`.
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
import threading
import time
from pathlib import Path

from realign.errors import UserError
from realign.launch.jobs import JobBackend, JobRecord, JobState, wait_finished

CONNECT_DEADLINE_S = 20.0

#: Ray's JobStatus -> the job states ``realign status`` shows
STATES = {"PENDING": "PENDING", "RUNNING": "RUNNING", "SUCCEEDED": "COMPLETED",
          "FAILED": "FAILED", "STOPPED": "CANCELLED"}

#: the driver's log, copied from the job API into the run folder by ``log_files``
DRIVER_LOG = "controller-ray-{job_id}.log"


def entrypoint(run_dir: Path) -> str:
    """The job's command: the controller of ``run_dir`` with the Ray launcher.

    >>> entrypoint(Path("/runs/a b"))
    "python -m realign.controller.main '/runs/a b' --launcher ray"
    """
    return shlex.join(["python", "-m", "realign.controller.main", str(run_dir),
                       "--launcher", "ray"])


def _with_deadline(fn, timeout_s: float, what: str):
    """``fn()``, or a UserError if it neither returns nor raises within ``timeout_s``
    (Ray's clients retry for a minute or more, or wait forever on a silent server)."""
    box: dict = {}

    def call():
        try:
            box["value"] = fn()
        except BaseException as e:                       # re-raised in the caller
            box["error"] = e

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        raise UserError(f"{what}: no answer within {timeout_s:.0f} s", field="launcher.address")
    if "error" in box:
        raise box["error"]
    return box["value"]


def job_client(address: str):
    """A ``JobSubmissionClient`` for ``address``; a UserError (what to start or fix)
    when nothing answers there."""
    from ray.job_submission import JobSubmissionClient

    from realign.launch.ray_launcher import check_reachable

    addr = None if address == "auto" else address
    if addr is not None and not addr.startswith("ray://"):
        check_reachable(addr)
    shown = address if addr else (os.environ.get("RAY_ADDRESS") or "auto (this machine)")
    try:
        return _with_deadline(lambda: JobSubmissionClient(addr), CONNECT_DEADLINE_S,
                              f"the Ray job API at {shown}")
    except UserError:
        raise
    except Exception as e:                  # ConnectionError, RuntimeError, RpcError, ...
        raise UserError(f"no Ray job API answers at {shown} ({type(e).__name__}: {e}); "
                        "start a head with `ray start --head` (dashboard included: "
                        "pip install 'ray[default]') or fix launcher.address, e.g. "
                        "http://HEAD:8265", field="launcher.address") from None


class RayJobBackend(JobBackend):
    name = "ray"

    def __init__(self):
        self._clients: dict[str, object] = {}

    def check_available(self) -> None:
        try:
            import ray.job_submission  # noqa: F401
            import requests  # noqa: F401  (the job API client needs ray[default])
        except ImportError as e:
            raise UserError(f"Ray job submission is not installed ({e}): pip install "
                            "'ray[default]' (see constraints.txt for the pinned version); "
                            "--launcher local runs on this machine") from None

    def _client(self, job: JobRecord):
        address = job.extra.get("address", "auto")
        if address not in self._clients:
            self._clients[address] = job_client(address)
        return self._clients[address]

    def submit(self, args: argparse.Namespace) -> JobRecord | None:
        from realign.launch.ray_launcher import ray_options
        from realign.run.prepare import prepare

        spec = prepare(args.experiment, run_dir=args.run_dir, steps=args.steps,
                       launcher=self.name)
        cfg = spec.config
        opts = ray_options(cfg)
        (spec.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        cmd = entrypoint(spec.run_dir)
        if args.dry_run:
            print(f"# ray job submit (address {opts.address}, runtime_env "
                  f"{opts.runtime_env or {}}):")
            print(cmd)
            print("# dry run: nothing submitted", file=sys.stderr)
            return None
        client = job_client(opts.address)
        job_id = client.submit_job(entrypoint=cmd, runtime_env=opts.runtime_env or None,
                                   metadata={"realign_run_dir": str(spec.run_dir),
                                             "realign_experiment": cfg.name})
        return JobRecord(backend=self.name, job_id=job_id, run_dir=str(spec.run_dir),
                         experiment=str(Path(args.experiment).resolve()),
                         submitted_at=time.time(), extra={"address": opts.address})

    def status(self, job: JobRecord) -> JobState:
        info = self._client(job).get_job_info(job.job_id)
        state = STATES.get(str(info.status.value), "UNKNOWN")
        detail = []
        if info.driver_exit_code is not None and state != "RUNNING":
            detail.append(f"exit {info.driver_exit_code}")
        if state in ("FAILED", "PENDING") and info.message:
            detail.append(info.message.splitlines()[0][:200])
        return JobState(state, ", ".join(detail))

    def cancel(self, job: JobRecord, timeout_s: float = 25.0) -> JobState:
        client = self._client(job)
        state = self.status(job)
        if state.finished:
            return state
        client.stop_job(job.job_id)       # SIGTERM, then SIGKILL; its actors die with it
        return wait_finished(lambda: self.status(job), timeout_s)

    def log_files(self, job: JobRecord) -> list[Path]:
        """The driver's (controller's) log, fetched from the job API into the run
        folder, then the workers' logs."""
        logs = Path(job.run_dir) / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        driver = logs / DRIVER_LOG.format(job_id=job.job_id)
        text = self._client(job).get_job_logs(job.job_id)
        if not driver.exists() or len(text.encode()) > driver.stat().st_size:
            tmp = driver.with_suffix(".part")
            tmp.write_text(text)
            os.replace(tmp, driver)
        return [driver] + [p for p in super().log_files(job) if p != driver]
