"""Pure parts of `realign submit/status/logs/cancel`: the job index, the run folder's
progress, the Slurm helpers (ports, scontrol/sinfo parsing) and the batch script.
No scheduler, no processes."""
from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from realign.config.experiment import SlurmLauncherConfig
from realign.errors import UserError
from realign.launch import backends, jobs
from realign.launch.slurm_backend import batch_script, partition_nodes
from realign.launch.slurm_common import job_ports, parse_kv

pytestmark = pytest.mark.pure


def test_job_index_round_trip_and_clear_miss(tmp_path, monkeypatch):
    monkeypatch.setenv("REALIGN_HOME", str(tmp_path / "home"))
    rec = jobs.JobRecord(backend="slurm", job_id="42", run_dir="/runs/x", experiment="e.yaml",
                         submitted_at=1.0, extra={"partition": "debug"})
    path = jobs.remember(rec)
    assert path == tmp_path / "home" / "jobs" / "42.json"
    assert jobs.find("42") == rec
    with pytest.raises(UserError, match=r"no job '7' in the job index .*recent jobs: 42"):
        jobs.find("7")
    with pytest.raises(UserError, match="is not a job id"):
        jobs.find("../etc/passwd")


def test_backend_table_rejects_unknown_names():
    with pytest.raises(UserError, match="unknown launcher 'pbs'; allowed: slurm, local"):
        backends.backend("pbs")


def test_progress_and_status_text_from_the_run_folder(tmp_path):
    from tests.run.specs import planned_spec

    assert jobs.progress(tmp_path) == (None, None, None)         # nothing prepared yet
    planned_spec(tmp_path, run={"steps": 24}).save()
    assert jobs.progress(tmp_path) == (0, 24, None)
    rows = [{"step": 0, "reward_mean": 0.1}, {"step": 1, "reward_mean": 0.25, "kl": 0.5}]
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows) + '{"step": 2, "rew')   # being written
    assert jobs.progress(tmp_path) == (2, 24, rows[1])
    rec = jobs.JobRecord(backend="slurm", job_id="9", run_dir=str(tmp_path))
    text = jobs.format_status(rec, jobs.JobState("RUNNING", "nodes n1"))
    assert text.splitlines() == [
        "job 9 (slurm): RUNNING  [nodes n1]", f"run folder: {tmp_path}", "step: 2 of 24",
        "last metrics: reward_mean=0.25  kl=0.5"]


def test_print_logs_controller_first_then_workers_by_rank(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    for name, text in [("worker10.log", "w10\n"), ("worker2.log", "w2\n"),
                       ("controller-5.log", "c\n")]:
        (logs / name).write_text(text)

    class B(jobs.JobBackend):
        check_available = submit = status = cancel = None

    files = B.log_files(None, jobs.JobRecord("slurm", "5", str(tmp_path)))
    assert [f.name for f in files] == ["controller-5.log", "worker2.log", "worker10.log"]
    out = io.StringIO()
    jobs.print_logs(lambda: files, lambda: jobs.JobState("COMPLETED"), follow=True, out=out,
                    poll_s=0.0)
    assert out.getvalue() == "".join(f"\n==> {f} <==\n{t}\n" for f, t in
                                     zip(files, ["c", "w2", "w10"]))


def test_slurm_helpers():
    assert job_ports(123) == (20246, 20247)
    assert job_ports(6123) == job_ports(123)
    assert all(20000 <= p < 32768 for j in range(0, 20000, 7) for p in job_ports(j))
    kv = parse_kv("JobId=7 JobName=realign-x JobState=CANCELLED Reason=None ExitCode=0:15")
    assert kv["JobState"] == "CANCELLED" and kv["ExitCode"] == "0:15"
    out = "n1 debug*\nn2 debug*\nn2 big\nn3 big\n"
    assert partition_nodes(out, None) == ("debug", 2, ["big", "debug"])
    assert partition_nodes(out, "big")[1] == 2
    with pytest.raises(UserError, match="no partition 'gpu' on this cluster; partitions: big, debug"):
        partition_nodes(out, "gpu")
    with pytest.raises(UserError, match="no default partition"):
        partition_nodes("n1 big\n", None)


def test_batch_script_lines():
    opts = SlurmLauncherConfig(type="slurm", partition="p1", account=None, time_limit="02:00:00",
                               cpus_per_task=4, sbatch_flags=["--exclusive", "--gres=gpu:8"],
                               env={"NCCL_DEBUG": "WARN"})
    s = batch_script(Path("/runs/r 1"), opts, nodes=2, tasks_per_node=8, experiment="ppo",
                     plan_text="2x8 h100-80g", python="/venv/bin/python")
    sb = [ln for ln in s.splitlines() if ln.startswith("#SBATCH")]
    assert sb == ["#SBATCH --job-name=realign-ppo", "#SBATCH --nodes=2",
                  "#SBATCH --ntasks-per-node=8", "#SBATCH --cpus-per-task=4",
                  "#SBATCH --time=02:00:00", "#SBATCH --partition=p1", "#SBATCH --requeue",
                  "#SBATCH --signal=B:USR1@300", "#SBATCH --open-mode=append",
                  "#SBATCH --output=/runs/r 1/logs/controller-%j.log",
                  "#SBATCH --exclusive", "#SBATCH --gres=gpu:8"]
    assert "export NCCL_DEBUG=WARN" in s
    assert ("/venv/bin/python -m realign.controller.main '/runs/r 1' --launcher slurm-step &"
            in s.splitlines())
    assert s.rstrip().endswith('exit "$rc"')


def test_a_cuda_job_asks_for_gpus_and_each_task_finds_its_own():
    from realign.launch.slurm_common import local_device
    from realign.launch.slurm_launcher import SlurmStepLauncher

    def script(device, **opts):
        return batch_script(Path("/r"), SlurmLauncherConfig(type="slurm", **opts), nodes=2,
                            tasks_per_node=8, experiment="e", plan_text="p", device=device)

    assert "#SBATCH --gpus-per-node=8" in script("cuda").splitlines()
    assert "#SBATCH --gpus-per-task=1" in script("cuda", gpus="per_task").splitlines()
    assert "--gpus" not in script("cpu")
    step = SlurmStepLauncher(Path("/r"), 7, "n[1-2]", 2, 8, SlurmLauncherConfig(type="slurm"),
                             ["/data"], device="cuda")
    assert "--gpus-per-node=8" in step.srun_command(16)
    boxed = SlurmStepLauncher(Path("/r"), 7, "n[1-2]", 2, 8, SlurmLauncherConfig(
        type="slurm", container_image="img.sqsh"), ["/data", "/models/a"], device="cuda")
    assert "--container-mounts=/data:/data,/models/a:/models/a,/r:/r" in boxed.srun_command(16)
    # whole-node allocation: every task sees the node's GPUs and takes its local rank's;
    # --gpus-per-task: each sees only its own, device 0
    assert local_device({"SLURM_LOCALID": "5", "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}) == 5
    assert local_device({"SLURM_LOCALID": "5", "CUDA_VISIBLE_DEVICES": "5"}) == 0
