"""``realign submit --launcher local``: the controller as a detached process on this
machine (the same run as ``realign run``, but the command returns at once).

The job id is ``local-<pid>`` of a small shell that runs the controller and records
its exit code in ``RUN/logs/local-job.rc``; ``cancel`` interrupts the controller
(SIGINT: it finishes its step, checkpoints and stops its workers; exit 3) and marks the
job cancelled. A controller stopped by a signal (exit 3) is ``PREEMPTED``: resumable.
"""
from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from realign.errors import UserError
from realign.launch.jobs import JobBackend, JobRecord, JobState
from realign.run.exit_codes import EXIT_PREEMPTED

RC_FILE = "local-job.rc"
CANCELLED_FILE = "local-job.cancelled"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:                                   # a zombie has finished
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


class LocalJobBackend(JobBackend):
    name = "local"

    def check_available(self) -> None:
        pass                               # this machine is always there

    def submit(self, args: argparse.Namespace) -> JobRecord | None:
        from realign.run.prepare import prepare

        spec = prepare(args.experiment, run_dir=args.run_dir, steps=args.steps,
                       launcher=self.name)
        logs = spec.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        for f in (RC_FILE, CANCELLED_FILE):
            (logs / f).unlink(missing_ok=True)
        controller = shlex.join([sys.executable, "-m", "realign.controller.main",
                                 str(spec.run_dir), "--launcher", "local"])
        script = f"{controller}; echo $? > {shlex.quote(str(logs / RC_FILE))}"
        if args.dry_run:
            print(script)
            return None
        with open(logs / "controller-local.log", "ab") as out:
            proc = subprocess.Popen(["/bin/sh", "-c", script], stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        return JobRecord(backend=self.name, job_id=f"local-{proc.pid}",
                         run_dir=str(spec.run_dir), experiment=str(Path(args.experiment).resolve()),
                         submitted_at=time.time())

    def _pid(self, job: JobRecord) -> int:
        return int(job.job_id.split("-", 1)[1])

    def status(self, job: JobRecord) -> JobState:
        logs = Path(job.run_dir) / "logs"
        if _alive(self._pid(job)) and not (logs / RC_FILE).exists():
            return JobState("RUNNING", f"pid {self._pid(job)}")
        if (logs / CANCELLED_FILE).exists():
            return JobState("CANCELLED")
        try:
            rc = int((logs / RC_FILE).read_text())
        except (OSError, ValueError):
            return JobState("UNKNOWN", "the controller ended without recording its exit code")
        if rc == EXIT_PREEMPTED:
            return JobState("PREEMPTED", f"exit {rc}: stopped after a checkpoint; submit the "
                                         "run folder again to resume")
        return JobState("COMPLETED" if rc == 0 else "FAILED", f"exit {rc}")

    def cancel(self, job: JobRecord, timeout_s: float = 25.0) -> JobState:
        state = self.status(job)
        if state.finished:
            return state
        (Path(job.run_dir) / "logs" / CANCELLED_FILE).touch()
        try:
            os.killpg(self._pid(job), signal.SIGINT)   # controller: KeyboardInterrupt
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + timeout_s
        while _alive(self._pid(job)) and time.monotonic() < deadline:
            time.sleep(0.3)
        if _alive(self._pid(job)):
            os.killpg(self._pid(job), signal.SIGKILL)
            raise UserError(f"job {job.job_id} did not stop within {timeout_s:.0f} s; killed")
        return self.status(job)
