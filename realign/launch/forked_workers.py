"""Workers forked from a preloaded process (:mod:`realign.worker.zygote`).

The local launcher's start for workers that see no GPU: one zygote per run imports
torch, megatron-core, transformers' tokenizer path and realign's runtime once, and
forks each worker from there, instead of each worker importing them itself
(``python -m realign.worker.main``). A GPU worker is not forked so: a process forked
after the CUDA driver was touched cannot use CUDA.

The zygote is the launcher's child (in the controller's process group; it ignores
SIGINT and SIGTERM); each worker leads its own session as before. The zygote reports
each worker's pid and, once it has reaped it, its exit code (:meth:`poll`); a
reader thread collects the reports.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from realign.launch.base import WorkerExit

REPORT_WAIT_S = 10.0     #: how long stop waits for a SIGKILLed worker's exit report


def parse_report(raw: bytes) -> tuple[str, int, int] | None:
    """One line of the zygote's reports: ``("started", pid, 0)``, ``("exit", pid,
    code)``, or None for any other line (``ready``, a blank or stray line), which the
    reader skips rather than stopping on."""
    words = raw.decode(errors="replace").split()
    if len(words) == 2 and words[0] == "started" and words[1].isdigit():
        return ("started", int(words[1]), 0)
    if (len(words) == 3 and words[0] == "exit" and words[1].isdigit()
            and words[2].lstrip("-").isdigit()):
        return ("exit", int(words[1]), int(words[2]))
    return None


class ForkedWorkers:
    """One run's workers, forked by a zygote started with ``base_env``."""

    def __init__(self, base_env: dict[str, str], envs: list[dict[str, str]],
                 log_paths: list[str]):
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self.pids: list[int] = []
        self.exits: dict[int, int] = {}
        self._zlog = open(Path(log_paths[0]).with_name("zygote.log"), "ab")
        self.zygote = subprocess.Popen(
            [sys.executable, "-m", "realign.worker.zygote"], env=base_env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._zlog)
        self._reader = threading.Thread(target=self._read, daemon=True,
                                        name="zygote-reports")
        self._reader.start()
        assert self.zygote.stdin is not None
        for env, log in zip(envs, log_paths):
            self.zygote.stdin.write(json.dumps({"env": env, "log": log}).encode() + b"\n")
        self.zygote.stdin.flush()
        self.n = len(envs)
        self._eof = False

    def _read(self) -> None:
        assert self.zygote.stdout is not None
        for raw in self.zygote.stdout:
            report = parse_report(raw)
            with self._changed:
                if report is not None and report[0] == "started":
                    self.pids.append(report[1])
                elif report is not None:
                    self.exits[report[1]] = report[2]
                self._changed.notify_all()
        with self._changed:
            self._eof = True
            self._changed.notify_all()

    def poll(self) -> list[WorkerExit]:
        """Workers that have exited; every worker not yet forked counts as exited
        with the zygote's code once the zygote has ended (it failed to import)."""
        with self._lock:
            out = [WorkerExit(r, self.exits[p]) for r, p in enumerate(self.pids)
                   if p in self.exits]
            if self._eof and len(self.pids) < self.n:
                code = self.zygote.wait()
                out += [WorkerExit(r, code or 1) for r in range(len(self.pids), self.n)]
        return out

    def _running(self) -> list[int]:
        with self._lock:
            return [p for p in self.pids if p not in self.exits]

    def _wait_exits(self, deadline: float) -> None:
        with self._changed:
            while (not self._eof and any(p not in self.exits for p in self.pids)
                   and time.monotonic() < deadline):
                self._changed.wait(max(0.0, min(0.2, deadline - time.monotonic())))

    def stop(self, grace_s: float) -> None:
        """SIGTERM every worker, SIGKILL what is left after ``grace_s``, then each
        worker's process group (what outlived it); then the zygote. A zygote that has
        not forked every worker yet is killed first, so that it forks no more."""
        with self._lock:
            all_forked = len(self.pids) == self.n
        if not all_forked:
            self.zygote.kill()
            self.zygote.wait()
            self._reader.join(timeout=REPORT_WAIT_S)
        for p in self._running():
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGTERM)
        self._wait_exits(time.monotonic() + grace_s)
        for p in self._running():
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        self._wait_exits(time.monotonic() + REPORT_WAIT_S)
        for p in list(self.pids):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p, signal.SIGKILL)        # what outlived its worker
        assert self.zygote.stdin is not None
        with contextlib.suppress(OSError):
            self.zygote.stdin.close()               # the zygote leaves once it has reaped
        try:
            self.zygote.wait(timeout=REPORT_WAIT_S)
        except subprocess.TimeoutExpired:
            self.zygote.kill()
            self.zygote.wait()
        self._reader.join(timeout=REPORT_WAIT_S)
        self._zlog.close()
