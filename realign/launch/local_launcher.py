"""Local launcher: one worker process per device of the plan, on this machine."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from typing import BinaryIO

from realign.launch.base import Launcher, WorkerExit


class LocalLauncher(Launcher):
    def __init__(self, threads_per_worker: int = 1):
        self.threads = threads_per_worker
        self.procs: list[subprocess.Popen] = []
        self._logs: list[BinaryIO] = []

    @classmethod
    def for_run(cls, spec) -> "LocalLauncher":
        """The launcher a prepared run (:class:`~realign.run.spec.RunSpec`) asks for."""
        return cls(threads_per_worker=spec.config.launcher.threads_per_worker)

    def start(self, envs: list[dict[str, str]], log_paths: list[str]) -> None:
        for env, log in zip(envs, log_paths):
            f = open(log, "ab")
            self._logs.append(f)
            full = dict(os.environ, OMP_NUM_THREADS=str(self.threads),
                        MKL_NUM_THREADS=str(self.threads), TOKENIZERS_PARALLELISM="false",
                        HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", **env)
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "realign.worker.main"], env=full, stdout=f,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True))

    def poll(self) -> list[WorkerExit]:
        return [WorkerExit(r, p.returncode) for r, p in enumerate(self.procs)
                if p.poll() is not None]

    def stop(self, grace_s: float = 5.0) -> None:
        """Stop every worker and what it started (each worker leads its own process
        group: a vLLM engine's child processes are in it)."""
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)        # what outlived its worker
        for f in self._logs:
            f.close()
