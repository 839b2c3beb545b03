"""Slurm: ``realign submit`` writes a batch script into the run folder and ``sbatch``es it.

Inside the allocation the script runs the controller on the job's first node
(``python -m realign.controller.main RUN --launcher slurm-step``); its
:class:`SlurmStepLauncher` starts all workers with one ``srun`` step, one task per
device (rank = ``SLURM_PROCID``). Because ``Launcher.start`` receives one environment
per rank, the launcher writes them to ``RUN/slurm/workers/rank<R>.json`` and every task
runs :mod:`realign.launch.slurm_task`, which picks its own. The job is submitted with
``--requeue``: a requeued job starts the controller again, which resumes from the run
folder's last complete checkpoint.

:class:`SlurmBackend` answers ``status``/``logs``/``cancel`` with ``scontrol`` and
``scancel`` (``sacct`` when the cluster keeps accounting and has forgotten the job).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from realign.errors import UserError
from realign.launch.base import Launcher, Network, WorkerExit
from realign.launch.jobs import JobBackend, JobRecord, JobState, wait_finished

#: client commands ``realign submit`` needs on PATH
SUBMIT_COMMANDS = ("sbatch", "sinfo", "scontrol")
SCRIPT = "job.sbatch"
CMD_TIMEOUT_S = 20.0
STOP_WAIT_S = 3.0        #: how long stop() lets the workers end on their own


def _slurm(cmd: list[str], what: str) -> str:
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


# ---- small pure helpers ---------------------------------------------------------------
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


def partition_nodes(sinfo_out: str, partition: str | None) -> tuple[str, int, list[str]]:
    """(partition, its node count, all partitions) from ``sinfo -h -N -o '%N %P'``; the
    default partition (``*``) when ``partition`` is None.

    >>> partition_nodes("n1 debug*\\nn2 debug*\\nn2 big\\n", None)
    ('debug', 2, ['big', 'debug'])
    """
    nodes: dict[str, set[str]] = {}
    default = None
    for line in sinfo_out.split("\n"):
        if not line.strip():
            continue
        node, part = line.split()[:2]
        if part.endswith("*"):
            part = part[:-1]
            default = part
        nodes.setdefault(part, set()).add(node)
    names = sorted(nodes)
    if partition is None:
        if default is None:
            raise UserError("the cluster has no default partition; set launcher.partition "
                            f"(partitions: {', '.join(names) or 'none'})",
                            field="launcher.partition")
        partition = default
    if partition not in nodes:
        raise UserError(f"no partition {partition!r} on this cluster; partitions: "
                        f"{', '.join(names) or 'none'}", field="launcher.partition")
    return partition, len(nodes[partition]), names


# ---- the batch script -----------------------------------------------------------------
def batch_script(run_dir: Path, opts, nodes: int, tasks_per_node: int, experiment: str,
                 plan_text: str, python: str = sys.executable) -> str:
    """The readable ``sbatch`` script of a prepared run folder."""
    q = shlex.quote
    logs = run_dir / "logs"
    lines = [
        "#!/bin/bash",
        f"# realign job: experiment {experiment}, plan {plan_text}, written by `realign submit`.",
        "# The controller runs here, on the job's first node; it starts one worker per device",
        "# with a single srun step (launcher slurm-step) and resumes from the run folder's",
        "# last checkpoint, so a requeued job carries on where it stopped.",
        f"# Submit it again by hand: sbatch {q(str(run_dir / SCRIPT))}",
        f"#SBATCH --job-name=realign-{experiment}",
        f"#SBATCH --nodes={nodes}",
        f"#SBATCH --ntasks-per-node={tasks_per_node}",
        f"#SBATCH --cpus-per-task={opts.cpus_per_task}",
        f"#SBATCH --time={opts.time_limit}",
    ]
    if opts.partition:
        lines.append(f"#SBATCH --partition={opts.partition}")
    if opts.account:
        lines.append(f"#SBATCH --account={opts.account}")
    lines += [
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        f"#SBATCH --output={logs}/controller-%j.log",
    ]
    lines += [f"#SBATCH {flag}" for flag in opts.sbatch_flags]
    lines += ["", "set -eo pipefail"]
    lines += [f"export {k}={q(v)}" for k, v in sorted(opts.env.items())]
    lines += [
        'echo "realign: job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on '
        '$SLURM_JOB_NODELIST, controller on $(hostname)"',
        f"exec {q(python)} -m realign.controller.main {q(str(run_dir))} --launcher slurm-step",
        "",
    ]
    return "\n".join(lines)


def _slurm_options(cfg):
    """The experiment's launcher section as Slurm options (defaults if it names
    another launcher, e.g. a run prepared for ``local`` started under Slurm by hand)."""
    from realign.config.experiment import SlurmLauncherConfig
    if isinstance(cfg.launcher, SlurmLauncherConfig):
        return cfg.launcher
    return SlurmLauncherConfig(type="slurm",
                               threads_per_worker=cfg.launcher.threads_per_worker)


def _shape(opts, plan, n_workers: int) -> tuple[int, int]:
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


class SlurmBackend(JobBackend):
    name = "slurm"

    def check_available(self) -> None:
        missing = [c for c in SUBMIT_COMMANDS if shutil.which(c) is None]
        if missing:
            raise UserError(f"{', '.join(missing)} not found on PATH: Slurm submission needs "
                            "Slurm's client commands (install slurm-client, or run on the "
                            "cluster's login node); --launcher local runs on this machine")

    def submit(self, args: argparse.Namespace) -> JobRecord | None:
        from realign.cli.run_cmd import prepare

        spec, cfg, plan = prepare(args)
        opts = _slurm_options(cfg)
        nodes, per_node = _shape(opts, plan, spec.n_workers)
        (spec.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        script = batch_script(spec.run_dir, opts, nodes, per_node, cfg.name,
                              f"{plan.cluster.n_nodes}x{plan.cluster.gpus_per_node} "
                              f"{plan.cluster.device.name}")
        path = spec.run_dir / SCRIPT
        path.write_text(script)
        if args.dry_run:
            print(script, end="")
            print(f"# dry run: nothing submitted; script saved to {path}", file=sys.stderr)
            return None
        part, have, _ = partition_nodes(
            _slurm(["sinfo", "-h", "-N", "-o", "%N %P"], "realign submit"), opts.partition)
        if nodes > have:
            raise UserError(f"the plan needs {nodes} nodes but partition {part!r} has {have}: "
                            "plan for fewer nodes (cluster.nodes) or choose a bigger "
                            "partition (launcher.partition)", field="cluster.nodes")
        out = _slurm(["sbatch", "--parsable", str(path)], "realign submit")
        job_id = out.strip().split(";")[0]
        return JobRecord(backend=self.name, job_id=job_id, run_dir=str(spec.run_dir),
                         experiment=str(Path(args.experiment).resolve()),
                         submitted_at=time.time(), extra={"partition": part})

    # ---- after submission ---------------------------------------------------------
    def _show(self, job: JobRecord) -> dict[str, str] | None:
        r = subprocess.run(["scontrol", "show", "job", "-o", job.job_id], capture_output=True,
                           text=True, timeout=CMD_TIMEOUT_S)
        if r.returncode != 0 or "JobState=" not in r.stdout:
            return None
        return parse_kv(r.stdout.splitlines()[0])

    def status(self, job: JobRecord) -> JobState:
        if shutil.which("scontrol") is None:
            raise UserError("scontrol is not on PATH: install slurm-client or run on the "
                            "cluster's login node")
        info = self._show(job)
        if info is not None:
            state = info["JobState"]
            detail = [f"exit {info['ExitCode']}" if state != "RUNNING" else "",
                      f"nodes {info['NodeList']}" if info.get("NodeList") not in
                      (None, "(null)") else "",
                      f"reason {info['Reason']}" if info.get("Reason") not in
                      (None, "None") else "",
                      f"restarts {info['Restarts']}" if info.get("Restarts", "0") != "0" else ""]
            return JobState(state, ", ".join(d for d in detail if d))
        r = subprocess.run(["sacct", "-n", "-X", "-P", "-j", job.job_id, "-o", "State"],
                           capture_output=True, text=True, timeout=CMD_TIMEOUT_S) \
            if shutil.which("sacct") else None
        if r is not None and r.returncode == 0 and r.stdout.strip():
            return JobState(r.stdout.split()[0].split()[0], "from sacct")
        return JobState("UNKNOWN", "Slurm no longer knows this job (finished and purged, "
                                   "no accounting); see the run folder")

    def cancel(self, job: JobRecord, timeout_s: float = 25.0) -> JobState:
        state = self.status(job)
        if state.finished:
            return state
        _slurm(["scancel", job.job_id], "realign cancel")
        return wait_finished(lambda: self.status(job), timeout_s)


# ---- inside the allocation ------------------------------------------------------------
class SlurmStepLauncher(Launcher):
    """Workers as the tasks of one ``srun`` step of the current Slurm job."""

    def __init__(self, run_dir: Path, job_id: int, nodelist: str, nodes: int,
                 tasks_per_node: int, opts, base_dir: str):
        self.run_dir, self.job_id, self.nodelist = Path(run_dir), job_id, nodelist
        self.nodes, self.tasks_per_node, self.opts = nodes, tasks_per_node, opts
        self.base_dir = base_dir
        self.env_dir = self.run_dir / "slurm" / "workers"
        self.proc: subprocess.Popen | None = None
        self._log = None

    @classmethod
    def for_run(cls, run_dir) -> "SlurmStepLauncher":
        from planner.plan import ExecutionPlan
        from realign.config.experiment import ExperimentConfig
        missing = [v for v in ("SLURM_JOB_ID", "SLURM_JOB_NODELIST") if v not in os.environ]
        if missing:
            raise UserError(f"the slurm-step launcher runs inside a Slurm job ({', '.join(missing)} "
                            "not set); submit with realign submit --launcher slurm",
                            field="--launcher")
        setup = json.loads((Path(run_dir) / "run_spec.json").read_text())["setup"]
        cfg = ExperimentConfig.model_validate(setup["config"])
        plan = ExecutionPlan.from_json(setup["plan"])
        opts = _slurm_options(cfg)
        n = plan.cluster.n_gpus
        nodes, per_node = _shape(opts, plan, n)
        return cls(Path(run_dir), int(os.environ["SLURM_JOB_ID"]),
                   os.environ["SLURM_JOB_NODELIST"], nodes, per_node, opts, setup["base"])

    def _first_node_addr(self) -> str:
        first = _slurm(["scontrol", "show", "hostnames", self.nodelist],
                       "the slurm-step launcher").split()[0]
        info = parse_kv(_slurm(["scontrol", "show", "node", "-o", first],
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
               "--job-name=realign-workers", "--export=ALL"]
        python = sys.executable
        if self.opts.container_image:
            mounts = sorted({str(self.run_dir), self.base_dir})
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
