"""Local launcher: one worker process per device of the plan, on this machine.

Workers that see no GPU (``device: cpu``: ``CUDA_VISIBLE_DEVICES`` empty) are forked
from one preloaded process per run (:mod:`realign.launch.forked_workers`), which
imports torch, megatron-core and the rest once for all of them; GPU workers start as
``python -m realign.worker.main`` each. Either way a worker leads its own process
group, writes to its log, and runs with ``threads_per_worker`` threads."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from typing import BinaryIO

from realign.launch.base import Launcher, WorkerExit
from realign.launch.forked_workers import ForkedWorkers


class LocalLauncher(Launcher):
    def __init__(self, threads_per_worker: int = 1):
        self.threads = threads_per_worker
        self.procs: list[subprocess.Popen] = []
        self._logs: list[BinaryIO] = []
        self.forked: ForkedWorkers | None = None

    @classmethod
    def for_run(cls, spec) -> "LocalLauncher":
        """The launcher a prepared run (:class:`~realign.run.spec.RunSpec`) asks for."""
        return cls(threads_per_worker=spec.config.launcher.threads_per_worker)

    def base_env(self) -> dict[str, str]:
        """This process's environment with what every worker of the run shares."""
        return dict(os.environ, OMP_NUM_THREADS=str(self.threads),
                    MKL_NUM_THREADS=str(self.threads), TOKENIZERS_PARALLELISM="false",
                    HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")

    def start(self, envs: list[dict[str, str]], log_paths: list[str]) -> None:
        if all(env.get("CUDA_VISIBLE_DEVICES") == "" for env in envs):
            self.forked = ForkedWorkers(dict(self.base_env(), CUDA_VISIBLE_DEVICES=""),
                                        envs, log_paths)
            return
        for env, log in zip(envs, log_paths):
            f = open(log, "ab")
            self._logs.append(f)
            full = dict(self.base_env(), **env)
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "realign.worker.main"], env=full, stdout=f,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True))

    def poll(self) -> list[WorkerExit]:
        if self.forked is not None:
            return self.forked.poll()
        return [WorkerExit(r, p.returncode) for r, p in enumerate(self.procs)
                if p.poll() is not None]

    def stop(self, grace_s: float = 5.0) -> None:
        """Stop every worker and what it started (each worker leads its own process
        group: a vLLM engine's child processes are in it)."""
        if self.forked is not None:
            self.forked.stop(grace_s)
            return
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
