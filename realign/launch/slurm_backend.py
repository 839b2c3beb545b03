"""Slurm: ``realign submit`` writes a batch script into the run folder and ``sbatch``es it.

Inside the allocation the script runs the controller on the job's first node
(``python -m realign.controller.main RUN --launcher slurm-step``), whose
:class:`~realign.launch.slurm_launcher.SlurmStepLauncher` starts the workers. The job is
submitted with ``--requeue``: a requeued job starts the controller again, which resumes
from the run folder's last complete checkpoint.

Before the time limit Slurm sends the batch shell SIGUSR1 (``--signal=B:USR1@<lead>``,
:func:`signal_lead_s`); the shell passes it to the controller, which finishes its step,
checkpoints and exits 3 (preempted, resumable), and the shell then requeues the job
(``scontrol requeue``). SIGUSR1 because Slurm's own signals mean something else: SIGTERM
is what ``scancel`` and the time limit itself send (a cancelled job must not requeue),
and USR1 is sent by nothing else. The shell requeues only after a USR1: a controller
stopped by ``scancel``'s SIGTERM exits 3 too, and stays stopped.

:class:`SlurmBackend` answers ``status``/``logs``/``cancel`` with ``scontrol`` and
``scancel`` (``sacct`` when the cluster keeps accounting and has forgotten the job).
"""
from __future__ import annotations

import argparse
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from realign.errors import UserError
from realign.launch.jobs import JobBackend, JobRecord, JobState, wait_finished
from realign.launch.slurm_common import CMD_TIMEOUT_S, gpu_flags, job_shape, parse_kv, slurm, slurm_options
from realign.run.exit_codes import EXIT_PREEMPTED

#: client commands ``realign submit`` needs on PATH
SUBMIT_COMMANDS = ("sbatch", "sinfo", "scontrol")
SCRIPT = "job.sbatch"
#: the signal's lead over the time limit: at least this ...
MIN_SIGNAL_LEAD_S = 300
#: ... and this many estimated steps plus :data:`SAVE_ALLOWANCE_S` for the checkpoint
SIGNAL_LEAD_STEPS = 3.0
SAVE_ALLOWANCE_S = 120.0
#: the most sbatch --signal accepts
MAX_SIGNAL_LEAD_S = 65535


def signal_lead_s(iteration_time_s: float | None) -> int:
    """Seconds before the time limit at which the job is asked to stop: room for the
    step in flight (:data:`SIGNAL_LEAD_STEPS` times the plan's estimate of one: estimates
    are rough) and a checkpoint, at least :data:`MIN_SIGNAL_LEAD_S`.

    >>> signal_lead_s(0.02), signal_lead_s(100.0), signal_lead_s(1e6)
    (300, 420, 65535)
    """
    need = SIGNAL_LEAD_STEPS * (iteration_time_s or 0.0) + SAVE_ALLOWANCE_S
    return int(min(MAX_SIGNAL_LEAD_S, max(MIN_SIGNAL_LEAD_S, -(-need // 1))))


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
                 plan_text: str, python: str = sys.executable, device: str = "cpu",
                 lead_s: int = MIN_SIGNAL_LEAD_S) -> str:
    """The readable ``sbatch`` script of a prepared run folder; ``lead_s``: how long
    before the time limit the job is asked to stop (:func:`signal_lead_s`)."""
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
    lines += [f"#SBATCH {flag}" for flag in gpu_flags(opts, device, tasks_per_node)]
    if opts.partition:
        lines.append(f"#SBATCH --partition={opts.partition}")
    if opts.account:
        lines.append(f"#SBATCH --account={opts.account}")
    lines += [
        "#SBATCH --requeue",
        f"#SBATCH --signal=B:USR1@{lead_s}",
        "#SBATCH --open-mode=append",
        f"#SBATCH --output={logs}/controller-%j.log",
    ]
    lines += [f"#SBATCH {flag}" for flag in opts.sbatch_flags]
    lines += ["", "set -o pipefail"]
    lines += [f"export {k}={q(v)}" for k, v in sorted(opts.env.items())]
    lines += [
        'echo "realign: job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on '
        '$SLURM_JOB_NODELIST, controller on $(hostname)"',
        "# The controller runs in the background so that this shell can pass it the",
        f"# signals: USR1, {lead_s} s before the time limit (--signal), asks it to finish its",
        "# step and checkpoint; it then exits 3 and the job requeues itself. TERM (scancel)",
        "# stops it the same way without a requeue.",
        f"{q(python)} -m realign.controller.main {q(str(run_dir))} --launcher slurm-step &",
        "controller=$!",
        "asked=",
        "trap 'asked=USR1; kill -USR1 $controller' USR1",
        "trap 'kill -TERM $controller' TERM",
        "trap 'kill -INT $controller' INT",
        "while :; do",
        "    wait $controller; rc=$?",
        "    kill -0 $controller 2>/dev/null || break     # a trap ended the wait, not an exit",
        "done",
        f'if [ "$rc" -eq {EXIT_PREEMPTED} ] && [ "$asked" = USR1 ]; then',
        '    echo "realign: stopped before the time limit; requeueing job $SLURM_JOB_ID"',
        '    scontrol requeue "$SLURM_JOB_ID"',
        "fi",
        'exit "$rc"',
        "",
    ]
    return "\n".join(lines)


class SlurmBackend(JobBackend):
    name = "slurm"

    def check_available(self) -> None:
        missing = [c for c in SUBMIT_COMMANDS if shutil.which(c) is None]
        if missing:
            raise UserError(f"{', '.join(missing)} not found on PATH: Slurm submission needs "
                            "Slurm's client commands (install slurm-client, or run on the "
                            "cluster's login node); --launcher local runs on this machine")

    def submit(self, args: argparse.Namespace) -> JobRecord | None:
        from realign.run.prepare import prepare

        spec = prepare(args.experiment, run_dir=args.run_dir, steps=args.steps,
                       launcher=self.name)
        cfg, plan = spec.config, spec.plan
        opts = slurm_options(cfg)
        nodes, per_node = job_shape(opts, plan, spec.n_workers)
        (spec.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        script = batch_script(spec.run_dir, opts, nodes, per_node, cfg.name,
                              f"{plan.cluster.n_nodes}x{plan.cluster.gpus_per_node} "
                              f"{plan.cluster.device.name}", device=cfg.device,
                              lead_s=signal_lead_s(plan.iteration_time_s))
        path = spec.run_dir / SCRIPT
        path.write_text(script)
        if args.dry_run:
            print(script, end="")
            print(f"# dry run: nothing submitted; script saved to {path}", file=sys.stderr)
            return None
        part, have, _ = partition_nodes(
            slurm(["sinfo", "-h", "-N", "-o", "%N %P"], "realign submit"), opts.partition)
        if nodes > have:
            raise UserError(f"the plan needs {nodes} nodes but partition {part!r} has {have}: "
                            "plan for fewer nodes (cluster.nodes) or choose a bigger "
                            "partition (launcher.partition)", field="cluster.nodes")
        out = slurm(["sbatch", "--parsable", str(path)], "realign submit")
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
        slurm(["scancel", job.job_id], "realign cancel")
        return wait_finished(lambda: self.status(job), timeout_s)
