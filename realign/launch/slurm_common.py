"""What Slurm's job back end and its in-allocation launcher share: running Slurm's
client commands, reading their output, the job's ports and its shape."""
from __future__ import annotations

import shlex
import subprocess
from typing import Mapping

from realign.errors import UserError

CMD_TIMEOUT_S = 20.0


def slurm(cmd: list[str], what: str) -> str:
    """Run a Slurm client command; its failure is a UserError quoting Slurm's words."""
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=CMD_TIMEOUT_S)
    except FileNotFoundError:
        raise UserError(f"{cmd[0]} is not on PATH: {what} needs Slurm's client commands "
                        "(install slurm-client, or run on the cluster's login node)") from None
    except subprocess.TimeoutExpired:
        raise UserError(f"{shlex.join(cmd)} did not answer within {CMD_TIMEOUT_S:.0f} s: is "
                        "slurmctld running and SLURM_CONF right?") from None
    if r.returncode != 0:
        raise UserError(f"{shlex.join(cmd)} failed: {(r.stderr or r.stdout).strip()}")
    return r.stdout


# ---- small pure helpers ----------------------------------------------------------------
def job_ports(job_id: int) -> tuple[int, int]:
    """(rendezvous port, controller port) of a job: a neighbouring pair below Linux's
    ephemeral range (32768+), different for job ids that differ modulo 6000, and the
    same again when the job is requeued.

    >>> job_ports(123)
    (20246, 20247)
    """
    base = 20000 + (job_id % 6000) * 2
    return base, base + 1


def parse_kv(line: str) -> dict[str, str]:
    """``scontrol -o`` output (``Key=Value`` words) as a dict; values have no spaces
    except the last key's, which takes the rest.

    >>> parse_kv("JobId=7 JobName=x JobState=RUNNING Reason=None")["JobState"]
    'RUNNING'
    """
    out: dict[str, str] = {}
    for word in line.split():
        if "=" in word:
            k, v = word.split("=", 1)
            out[k] = v
    return out


def gpu_flags(opts, device: str, tasks_per_node: int) -> list[str]:
    """The GPU request of a job and of its srun step (none for device cpu).

    >>> from realign.config.experiment import SlurmLauncherConfig as C
    >>> gpu_flags(C(type="slurm"), "cuda", 8), gpu_flags(C(type="slurm", gpus="per_task"), "cuda", 8)
    (['--gpus-per-node=8'], ['--gpus-per-task=1'])
    """
    if device != "cuda":
        return []
    if opts.gpus == "per_task":
        return ["--gpus-per-task=1"]
    return [f"--gpus-per-node={tasks_per_node}"]


def local_device(env: Mapping[str, str]) -> int:
    """The CUDA device index a task uses, from its Slurm environment: its local rank
    when it sees several GPUs (--gpus-per-node: all the node's), 0 when it sees one
    (--gpus-per-task=1: only its own; CUDA_VISIBLE_DEVICES then names one device).

    >>> local_device({"SLURM_LOCALID": "3", "CUDA_VISIBLE_DEVICES": "0,1,2,3"})
    3
    >>> local_device({"SLURM_LOCALID": "3", "CUDA_VISIBLE_DEVICES": "3"})
    0
    >>> local_device({"SLURM_LOCALID": "3"})
    3
    """
    visible = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if len(visible) == 1:
        return 0
    return int(env["SLURM_LOCALID"])


def slurm_options(cfg):
    """The experiment's launcher section as Slurm options (defaults if it names
    another launcher, e.g. a run prepared for ``local`` started under Slurm by hand)."""
    from realign.config.experiment import SlurmLauncherConfig
    if isinstance(cfg.launcher, SlurmLauncherConfig):
        return cfg.launcher
    return SlurmLauncherConfig(type="slurm",
                               threads_per_worker=cfg.launcher.threads_per_worker)


def job_shape(opts, plan, n_workers: int) -> tuple[int, int]:
    """(nodes, tasks per node) of the job: the launcher options or the plan's cluster."""
    nodes = opts.nodes or plan.cluster.n_nodes
    per_node = opts.gpus_per_node or plan.cluster.gpus_per_node
    if nodes * per_node != n_workers:
        raise UserError(f"{nodes} nodes x {per_node} tasks per node = {nodes * per_node} "
                        f"workers, but the plan has {n_workers} devices "
                        f"({plan.cluster.n_nodes}x{plan.cluster.gpus_per_node}); leave "
                        "launcher.nodes/gpus_per_node unset to follow the plan",
                        field="launcher.nodes")
    return nodes, per_node
