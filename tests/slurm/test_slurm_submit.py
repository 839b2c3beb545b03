"""`realign submit/status/logs/cancel` through a real one-node Slurm cluster (started by
the session fixture): the tiny GRPO experiment runs to completion and learns, a
cancelled job leaves a usable checkpoint that a new submit resumes from, and bad
input exits with code 2 at once."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from realign.run import checkpoint
from tests.run.conftest import experiment
from tests.run.run_records import metrics

pytestmark = pytest.mark.slurm

REALIGN = [sys.executable, "-m", "realign.cli.main"]
JOB_TIMEOUT_S = 240


def realign(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*REALIGN, *args], capture_output=True, text=True, timeout=timeout,
                          env=env)


def submit(exp: Path, run_dir: Path, *extra: str) -> str:
    r = realign("submit", str(exp), "--launcher", "slurm", "--run-dir", str(run_dir), *extra)
    assert r.returncode == 0, r.stdout + r.stderr
    m = re.search(r"submitted job (\S+) \(slurm\)", r.stdout)
    assert m and f"run folder: {run_dir}" in r.stdout, r.stdout
    return m.group(1)


def status(job: str) -> dict:
    r = realign("status", job, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def wait_for(job: str, cond, timeout: float = JOB_TIMEOUT_S, what: str = "") -> dict:
    deadline = time.monotonic() + timeout
    while True:
        s = status(job)
        if cond(s):
            return s
        assert time.monotonic() < deadline, f"job {job}: no {what} within {timeout} s: {s}\n" \
            + realign("logs", job).stdout[-4000:]
        time.sleep(1.0)


def finished(s: dict) -> bool:
    return s["state"] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL")


def worker_pids(run_dir: Path) -> list[int]:
    """Processes whose environment names a worker log in ``run_dir`` (workers and their
    slurm_task wrappers)."""
    key = f"REALIGN_WORKER_LOG={run_dir}/logs/worker".encode()
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if key in (d / "environ").read_bytes():
                    pids.append(int(d.name))
            except OSError:
                continue
    return pids


def worker_pid(run_dir: Path, rank: int) -> int:
    for pid in worker_pids(run_dir):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and b"realign.worker.main" in \
                Path(f"/proc/{pid}/cmdline").read_bytes():
            return pid
    raise AssertionError(f"no worker {rank} of {run_dir} running")


def test_grpo_runs_to_completion_and_learns(slurm_cluster, tiny_assets, tmp_path):
    exp = experiment(tiny_assets, "tiny-grpo-cpu", tmp_path, run__steps=24,
                     launcher={"type": "slurm", "time_limit": "00:10:00"})
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    job = submit(exp, run_dir)
    s = wait_for(job, finished, what="end")
    wall = time.monotonic() - t0
    assert s["state"] == "COMPLETED", (s, realign("logs", job).stdout[-4000:])
    rows = metrics(run_dir)
    assert [row["step"] for row in rows] == list(range(24))
    assert s["step"] == 24 and s["steps"] == 24 and s["last_metrics"]["step"] == 23
    first = sum(row["reward_mean"] for row in rows[:5]) / 5
    last = sum(row["reward_mean"] for row in rows[-5:]) / 5
    assert last > first + 0.08, (first, last)
    assert (run_dir / "final" / "actor" / "config.json").is_file()
    # the text status and the logs: controller first, then both workers
    text = realign("status", job).stdout
    assert f"job {job} (slurm): COMPLETED" in text and "step: 24 of 24" in text, text
    logs = realign("logs", job).stdout
    assert f"controller-{job}.log" in logs and "final actor saved" in logs
    assert "worker0.log" in logs and "worker1.log" in logs
    assert "realign.launch.slurm_task" in (run_dir / "logs" / f"srun-{job}.log").read_text()
    print(f"\nslurm job {job}: 24 steps in {wall:.1f} s, reward {first:.3f} -> {last:.3f}")


def test_requeue_and_cancel_resume_from_the_last_checkpoint(slurm_cluster, tiny_assets,
                                                            tmp_path):
    """Requeued by Slurm, the job resumes from its last checkpoint; cancelled, its workers
    are gone within 30 s and a new submit of the run folder resumes from the checkpoint;
    a worker killed there is named by the controller and the job fails."""
    exp = experiment(tiny_assets, "tiny-grpo-cpu", tmp_path, run__steps=2000,
                     run__checkpoint_interval=3, launcher={"type": "slurm"})
    run_dir = tmp_path / "run"
    job = submit(exp, run_dir)
    wait_for(job, lambda s: s["state"] == "RUNNING" and (s["step"] or 0) >= 7, what="step 7")
    first_ckpt = checkpoint.latest(run_dir)[0]
    r = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr

    def restarted_log() -> str:
        log = (run_dir / "logs" / f"controller-{job}.log").read_text()
        marker = f"realign: job {job} (restart 1)"
        return log[log.index(marker):] if marker in log else ""

    # the first run's metrics past its checkpoint stay until the restart truncates them
    # (before it logs "resuming"), so wait for that line, then for steps past it
    wait_for(job, lambda s: s["state"] == "RUNNING" and "restarts 1" in s["detail"]
             and "resuming from" in restarted_log(), what="a restart that resumed")
    resumed = int(re.search(r"resuming from \S+ \(step (\d+)\)", restarted_log()).group(1))
    assert resumed >= first_ckpt and resumed % 3 == 0, (first_ckpt, resumed)
    wait_for(job, lambda s: (s["step"] or 0) >= resumed + 2, what="steps past the checkpoint")

    assert checkpoint.latest(run_dir) is not None
    assert worker_pids(run_dir), "no worker process found"
    follow = subprocess.Popen([*REALIGN, "logs", job, "--follow"], stdout=subprocess.PIPE,
                              text=True)
    t0 = time.monotonic()
    r = realign("cancel", job)
    assert r.returncode == 0, r.stderr
    assert f"job {job} (slurm): CANCELLED" in r.stdout, r.stdout
    while worker_pids(run_dir) and time.monotonic() - t0 < 30:
        time.sleep(0.5)
    gone_s = time.monotonic() - t0
    assert not worker_pids(run_dir), f"workers still running {gone_s:.0f} s after cancel"
    assert status(job)["state"] == "CANCELLED"
    out, _ = follow.communicate(timeout=30)         # --follow ends with the job
    assert follow.returncode == 0 and "worker0.log" in out

    steps, ckpt = checkpoint.latest(run_dir)
    assert steps >= 6 and steps % 3 == 0, steps
    for rank in (0, 1):
        state = torch.load(ckpt / f"rank{rank}.pt", weights_only=False)
        assert state, f"rank {rank} checkpoint is empty"
    done = len(metrics(run_dir))
    assert done >= steps

    # a new submit resumes; then a worker killed under Slurm is named and the job fails
    job2 = submit(exp, run_dir, "--steps", str(steps + 1000))
    assert job2 != job
    # metrics.jsonl still holds the cancelled job's steps past its checkpoint (up to
    # `done`) until the new controller truncates it: wait for steps beyond those
    wait_for(job2, lambda s: s["state"] == "RUNNING" and (s["step"] or 0) >= done + 2,
             what="resumed steps")
    log2 = (run_dir / "logs" / f"controller-{job2}.log").read_text()
    assert f"resuming from {ckpt} (step {steps})" in log2, log2
    rows = metrics(run_dir)
    assert [row["step"] for row in rows[:steps + 2]] == list(range(steps + 2))
    os.kill(worker_pid(run_dir, rank=1), signal.SIGKILL)
    s = wait_for(job2, finished, timeout=60, what="end after a worker was killed")
    assert s["state"] == "FAILED", s
    log2 = (run_dir / "logs" / f"controller-{job2}.log").read_text()
    assert "worker 1 failed" in log2, log2[-3000:]
    assert "killed (signal 9)" in log2 or "exited with code -9" in log2, log2[-3000:]
    print(f"\nrequeued after checkpoint {first_ckpt}, resumed from {resumed}; cancelled at step "
          f"{done} (workers gone in {gone_s:.1f} s), checkpoint {steps}, resumed; "
          + re.search(r"worker 1 failed.*\n.*", log2).group(0).replace("\n", " "))


def test_dry_run_prints_the_batch_script(slurm_cluster, tiny_assets, tmp_path):
    exp = experiment(tiny_assets, "tiny-grpo-cpu", tmp_path, launcher={
        "type": "slurm", "partition": "debug", "account": "proj1", "time_limit": "00:20:00",
        "cpus_per_task": 1, "sbatch_flags": ["--exclusive"], "env": {"FOO": "a b"}})
    run_dir = tmp_path / "run"
    before = slurm_cluster.squeue()
    r = realign("submit", str(exp), "--dry-run", "--run-dir", str(run_dir))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "#!/bin/bash"
    sb = [ln for ln in lines if ln.startswith("#SBATCH ")]
    for want in ("--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1", "--time=00:20:00",
                 "--partition=debug", "--account=proj1", "--requeue", "--exclusive",
                 f"--output={run_dir}/logs/controller-%j.log"):
        assert f"#SBATCH {want}" in sb, (want, sb)
    assert "export FOO='a b'" in lines
    # the controller runs in the background so the batch shell can pass it Slurm's
    # warning signal; the script then exits with the controller's code
    assert any(ln.endswith(f"-m realign.controller.main {run_dir} --launcher slurm-step &")
               for ln in lines), lines
    assert any(ln.startswith("#SBATCH --signal=B:USR1@") for ln in sb), sb
    assert lines[-1] == 'exit "$rc"'

    assert (run_dir / "job.sbatch").read_text() == r.stdout
    assert slurm_cluster.squeue() == before, "a dry run submitted a job"
    assert "submitted job" not in r.stdout


def test_sbatch_missing_is_a_fast_clear_error(tiny_assets, tmp_path):
    exp = experiment(tiny_assets, "tiny-grpo-cpu", tmp_path, launcher={"type": "slurm"})
    env = dict(os.environ, PATH=str(Path(sys.executable).parent))   # no sbatch there
    t0 = time.monotonic()
    r = realign("submit", str(exp), "--run-dir", str(tmp_path / "run"), env=env, timeout=30)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "sbatch" in r.stderr and "not found on PATH" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert time.monotonic() - t0 < 30


def test_plan_larger_than_the_partition_is_refused(slurm_cluster, tiny_assets, tmp_path):
    exp = experiment(tiny_assets, "tiny-grpo-cpu", tmp_path, cluster__nodes=2,
                     cluster__gpus_per_node=1, launcher={"type": "slurm"})
    before = slurm_cluster.squeue()
    t0 = time.monotonic()
    r = realign("submit", str(exp), "--run-dir", str(tmp_path / "run"), timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "needs 2 nodes but partition 'debug' has 1" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert time.monotonic() - t0 < 30
    assert slurm_cluster.squeue() == before


def test_unknown_job_is_a_clear_error(slurm_cluster):
    for cmd in ("status", "logs", "cancel"):
        r = realign(cmd, "987654")
        assert r.returncode == 2, r.stdout + r.stderr
        assert "no job '987654' in the job index" in r.stderr, r.stderr
