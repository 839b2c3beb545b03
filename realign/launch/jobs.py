"""Batch jobs: ``realign submit / status / logs / cancel`` across back ends.

A :class:`JobBackend` submits a prepared run folder to a scheduler (Slurm, Ray, a
detached local process) and answers for the job afterwards. Back ends are named in
the explicit table :data:`realign.launch.backends.BACKENDS`.
A submitted job is remembered in the *job index*: one small JSON file per job under
``$REALIGN_HOME/jobs/`` (default ``~/.cache/realign/jobs/``) naming its back end, id
and run folder, so ``realign status JOB`` works from any directory.

What every back end shares is read from the run folder: the step and last metrics
(``RUN/metrics.jsonl``) and the logs (``RUN/logs/``).
"""
from __future__ import annotations

import abc
import argparse
import json
import os
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from realign.errors import UserError

#: states after which a job does nothing more
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
            "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "STOPPED", "UNKNOWN"}


@dataclass(frozen=True)
class JobRecord:
    """One line of the job index: enough to find the job and its run folder again."""

    backend: str
    job_id: str
    run_dir: str
    experiment: str = ""
    submitted_at: float = 0.0
    extra: dict = field(default_factory=dict)   #: back-end specifics (e.g. a Ray address)


@dataclass(frozen=True)
class JobState:
    state: str            #: PENDING | RUNNING | COMPLETED | FAILED | CANCELLED | ...
    detail: str = ""      #: the scheduler's own words (reason, exit code, node list)

    @property
    def finished(self) -> bool:
        return self.state in TERMINAL


class JobBackend(abc.ABC):
    """Submit a run to one kind of scheduler and answer for the job afterwards."""

    name: str = ""

    @abc.abstractmethod
    def check_available(self) -> None:
        """Raise :class:`UserError` (what to install or start) unless usable; fast."""

    @abc.abstractmethod
    def submit(self, args: argparse.Namespace) -> JobRecord | None:
        """Prepare the run folder and submit it; ``args.dry_run``: show, submit nothing
        (return None)."""

    @abc.abstractmethod
    def status(self, job: JobRecord) -> JobState:
        """The scheduler's state of the job."""

    @abc.abstractmethod
    def cancel(self, job: JobRecord, timeout_s: float = 25.0) -> JobState:
        """Stop the job (workers included); wait up to ``timeout_s`` for it to end."""

    def log_files(self, job: JobRecord) -> list[Path]:
        """Controller log(s) first, then the workers' logs."""
        logs = Path(job.run_dir) / "logs"
        if not logs.is_dir():
            return []
        workers = sorted(logs.glob("worker*.log"), key=lambda p: _rank_key(p.name))
        others = sorted(p for p in logs.iterdir() if p.is_file() and p not in workers)
        return others + workers


def wait_finished(status, timeout_s: float, poll_s: float = 0.5) -> "JobState":
    """Poll ``status()`` until the job has finished or ``timeout_s`` passed; the last state."""
    deadline = time.monotonic() + timeout_s
    state = status()
    while not state.finished and time.monotonic() < deadline:
        time.sleep(poll_s)
        state = status()
    return state


def _rank_key(name: str) -> int:
    m = re.search(r"(\d+)", name)
    return int(m.group(1)) if m else -1


# ---- the job index -------------------------------------------------------------------
def index_dir() -> Path:
    home = os.environ.get("REALIGN_HOME") or str(Path.home() / ".cache" / "realign")
    return Path(home) / "jobs"


def _index_path(job_id: str) -> Path:
    if not re.fullmatch(r"[A-Za-z0-9_.:-]+", job_id):
        raise UserError(f"{job_id!r} is not a job id (letters, digits, '_', '-', '.', ':')",
                        field="JOB")
    return index_dir() / f"{job_id.replace(':', '_')}.json"


def remember(job: JobRecord) -> Path:
    p = _index_path(job.job_id)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(".part")
    tmp.write_text(json.dumps(asdict(job), indent=1))
    os.replace(tmp, p)
    return p


def find(job_id: str) -> JobRecord:
    p = _index_path(job_id)
    if not p.is_file():
        known = sorted(f.stem for f in index_dir().glob("*.json"))[-5:]
        hint = f"; recent jobs: {', '.join(known)}" if known else ""
        raise UserError(f"no job {job_id!r} in the job index {index_dir()} (jobs are "
                        f"recorded by realign submit; REALIGN_HOME moves the index){hint}",
                        field="JOB")
    try:
        return JobRecord(**json.loads(p.read_text()))
    except (ValueError, TypeError, UnicodeDecodeError) as e:
        raise UserError(f"the job index entry {p} is damaged ({e}); the run folder is intact: "
                        "remove the entry and run realign submit on it again to resume",
                        field="JOB") from None


# ---- what the run folder says ---------------------------------------------------------
def progress(run_dir: str | Path) -> tuple[int | None, int | None, dict | None]:
    """(steps done, total steps, last metrics row) from the run folder."""
    from realign.run.spec import RunSpec

    run_dir = Path(run_dir)
    total = None
    try:
        total = RunSpec.load(run_dir).steps
    except UserError:
        pass
    last = None
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        for line in reversed(lines):
            try:
                last = json.loads(line)
                break
            except ValueError:       # a line being written
                continue
    except OSError:
        pass
    done = last["step"] + 1 if last and "step" in last else (0 if total else None)
    return done, total, last


def format_status(job: JobRecord, state: JobState) -> str:
    done, total, last = progress(Path(job.run_dir))
    lines = [f"job {job.job_id} ({job.backend}): {state.state}"
             + (f"  [{state.detail}]" if state.detail else ""),
             f"run folder: {job.run_dir}"]
    if total is not None:
        lines.append(f"step: {done} of {total}")
    if last:
        keys = ["reward_mean", "actor.loss", "kl", "step_time_s", "tokens_per_s"]
        shown = [k for k in keys if k in last] or \
            [k for k in last if k != "step" and not k.startswith("time.")][:6]
        lines.append("last metrics: " + "  ".join(f"{k}={_num(last[k])}" for k in shown))
    return "\n".join(lines)


def _num(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def print_logs(files_of, state_of, follow: bool, out=sys.stdout, poll_s: float = 1.0) -> None:
    """Print every log (``==> path <==`` headers, like ``tail``); with ``follow``, keep
    printing what is appended until the job has finished. ``files_of()`` lists the
    logs (new ones appear as workers start), ``state_of()`` is the job's state."""
    offsets: dict[Path, int] = {}
    current: list[Path | None] = [None]

    def drain() -> None:
        for f in files_of():
            try:
                with open(f, "rb") as fh:
                    fh.seek(offsets.get(f, 0))
                    data = fh.read()
            except OSError:
                continue
            if not data:
                continue
            offsets[f] = offsets.get(f, 0) + len(data)
            if current[0] != f:
                out.write(f"\n==> {f} <==\n")
                current[0] = f
            out.write(data.decode(errors="replace"))
            out.flush()

    drain()
    while follow:
        finished = state_of().finished
        time.sleep(poll_s)
        drain()
        if finished:
            return
