"""Slurm, inside the allocation: :class:`SlurmStepLauncher` starts all workers of a run
with one ``srun`` step, one task per device (rank = ``SLURM_PROCID``).

Because ``Launcher.start`` receives one environment per rank, the launcher writes them
to ``RUN/slurm/workers/rank<R>.json`` and every task runs
:mod:`realign.launch.slurm_task`, which picks its own. The controller listens on the
job's first node (``NodeAddr``) at a port derived from the job id.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import BinaryIO

from realign.errors import UserError
from realign.launch.base import Launcher, Network, WorkerExit
from realign.launch.slurm_common import gpu_flags, job_ports, job_shape, parse_kv, slurm, slurm_options
from realign.paths import named_paths

STOP_WAIT_S = 3.0        #: how long stop() lets the workers end on their own


def data_folders(spec) -> list[str]:
    """The folders a container must see besides the run folder: the models' checkpoint
    folders and the folder of every other file the experiment names
    (:func:`realign.paths.named_paths`: datasets, adapters, user code...)."""
    named = [p if p.is_dir() else p.parent for p in named_paths(spec.config).values()]
    return sorted({str(p) for p in (*named, *spec.paths.values())})


class SlurmStepLauncher(Launcher):
    """Workers as the tasks of one ``srun`` step of the current Slurm job."""

    def __init__(self, run_dir: Path, job_id: int, nodelist: str, nodes: int,
                 tasks_per_node: int, opts, mounts: list[str], device: str = "cpu"):
        self.run_dir, self.job_id, self.nodelist = Path(run_dir), job_id, nodelist
        self.nodes, self.tasks_per_node, self.opts = nodes, tasks_per_node, opts
        self.mounts, self.device = mounts, device
        self.env_dir = self.run_dir / "slurm" / "workers"
        self.proc: subprocess.Popen | None = None
        self._log: BinaryIO | None = None

    @classmethod
    def for_run(cls, spec) -> "SlurmStepLauncher":
        """The launcher of a prepared run (:class:`~realign.run.spec.RunSpec`) in this job."""
        missing = [v for v in ("SLURM_JOB_ID", "SLURM_JOB_NODELIST") if v not in os.environ]
        if missing:
            raise UserError(f"the slurm-step launcher runs inside a Slurm job ({', '.join(missing)} "
                            "not set); submit with realign submit --launcher slurm",
                            field="--launcher")
        opts = slurm_options(spec.config)
        nodes, per_node = job_shape(opts, spec.plan, spec.n_workers)
        return cls(spec.run_dir, int(os.environ["SLURM_JOB_ID"]),
                   os.environ["SLURM_JOB_NODELIST"], nodes, per_node, opts,
                   data_folders(spec), spec.config.device)

    def _first_node_addr(self) -> str:
        first = slurm(["scontrol", "show", "hostnames", self.nodelist],
                       "the slurm-step launcher").split()[0]
        info = parse_kv(slurm(["scontrol", "show", "node", "-o", first],
                               "the slurm-step launcher"))
        return info.get("NodeAddr") or first

    def network(self) -> Network:
        addr = self._first_node_addr()
        master, controller = job_ports(self.job_id)
        return Network(master_addr=addr, master_port=master, bind_host="0.0.0.0",
                       advertise_host=addr, controller_port=controller)

    def srun_command(self, n: int) -> list[str]:
        cmd = ["srun", f"--ntasks={n}", f"--nodes={self.nodes}",
               f"--ntasks-per-node={self.tasks_per_node}",
               f"--cpus-per-task={self.opts.cpus_per_task}", "--kill-on-bad-exit=0",
               "--job-name=realign-workers", "--export=ALL",
               *gpu_flags(self.opts, self.device, self.tasks_per_node)]
        python = sys.executable
        if self.opts.container_image:
            mounts = sorted({str(self.run_dir), *self.mounts})
            cmd += [f"--container-image={self.opts.container_image}",
                    f"--container-mounts={','.join(f'{m}:{m}' for m in mounts)}"]
            python = "python"                  # the image's own Python (realign installed)
        return cmd + [python, "-m", "realign.launch.slurm_task", str(self.env_dir)]

    def start(self, envs: list[dict[str, str]], log_paths: list[str]) -> None:
        if self.env_dir.exists():
            shutil.rmtree(self.env_dir)
        (self.env_dir / "exit").mkdir(parents=True)
        self.env_dir.chmod(0o700)              # the files hold the controller's key
        t = str(self.opts.threads_per_worker)
        for rank, env in enumerate(envs):
            full = dict(env, OMP_NUM_THREADS=t, MKL_NUM_THREADS=t, TOKENIZERS_PARALLELISM="false",
                        HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", **self.opts.env)
            p = self.env_dir / f"rank{rank}.json"
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(full, f)
        self._log = open(self.run_dir / "logs" / f"srun-{self.job_id}.log", "ab")
        cmd = self.srun_command(len(envs))
        self._log.write(f"$ {shlex.join(cmd)}\n".encode())
        self._log.flush()
        self.n = len(envs)
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)

    def poll(self) -> list[WorkerExit]:
        exits = {}
        for f in (self.env_dir / "exit").glob("rank*"):
            if f.suffix == ".part":
                continue
            try:
                exits[int(f.name[4:])] = int(f.read_text())
            except ValueError:                 # being written
                continue
        if self.proc is not None and self.proc.poll() is not None:
            for r in range(self.n):
                exits.setdefault(r, self.proc.returncode)   # never started or killed
        return [WorkerExit(r, rc) for r, rc in sorted(exits.items())]

    def stop(self, grace_s: float = 5.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:                               # after "stop" the workers exit by themselves
                self.proc.wait(timeout=min(grace_s, STOP_WAIT_S))
            except subprocess.TimeoutExpired:
                pass
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)          # srun ends every task
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log is not None:
            self._log.close()
