"""The Slurm batch script's stop path, without Slurm: the script asks for SIGUSR1 before
the time limit and is requeueable; run by bash with a stand-in controller (exits 3,
"preempted, resumable", on a stop signal) and a stand-in ``scontrol`` that records its
arguments, a USR1 is passed to the controller and the job requeues itself, while a TERM
(``scancel``) stops it without a requeue."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from realign.config.experiment import SlurmLauncherConfig
from realign.launch.slurm_backend import batch_script, signal_lead_s
from realign.run.exit_codes import EXIT_PREEMPTED

pytestmark = pytest.mark.pure        # bash and stand-ins: no Slurm, no torch

FAKE_CONTROLLER = f"""#!/bin/sh
echo started > "$(dirname "$0")/controller.started"
trap 'exit {EXIT_PREEMPTED}' USR1 TERM INT
while :; do sleep 0.05; done
"""


def script(tmp: Path, lead_s: int = 420) -> str:
    return batch_script(tmp / "run", SlurmLauncherConfig(type="slurm"), 1, 2, "tiny",
                        "1x2 cpu", python=str(tmp / "python"), lead_s=lead_s)


def test_the_script_asks_for_usr1_before_the_limit_and_is_requeueable(tmp_path):
    text = script(tmp_path, lead_s=signal_lead_s(100.0))
    lines = text.splitlines()
    assert "#SBATCH --signal=B:USR1@420" in lines
    assert "#SBATCH --requeue" in lines
    assert 'scontrol requeue "$SLURM_JOB_ID"' in text


def test_signal_lead_covers_a_step_and_a_checkpoint():
    assert signal_lead_s(None) == signal_lead_s(0.0) == 300
    assert signal_lead_s(200.0) == 720                 # 3 steps of 200 s + 120 s
    assert signal_lead_s(1e9) == 65535                 # what sbatch accepts


def _run_script(tmp: Path, sig: int) -> tuple[int, str]:
    (tmp / "run" / "logs").mkdir(parents=True)
    bindir = tmp / "bin"
    bindir.mkdir()
    for path, body in ((tmp / "python", FAKE_CONTROLLER),
                       (bindir / "scontrol", f'#!/bin/sh\necho "$@" >> {tmp}/scontrol.calls\n')):
        path.write_text(body)
        path.chmod(0o755)
    job = tmp / "job.sbatch"
    job.write_text(script(tmp))
    env = dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}", SLURM_JOB_ID="77")
    p = subprocess.Popen(["bash", str(job)], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 30
    while not (tmp / "controller.started").exists():
        assert time.monotonic() < deadline and p.poll() is None, "controller did not start"
        time.sleep(0.05)
    time.sleep(0.2)                                   # the shell has set its traps
    p.send_signal(sig)
    out, _ = p.communicate(timeout=30)
    calls = (tmp / "scontrol.calls").read_text() if (tmp / "scontrol.calls").exists() else ""
    return p.returncode, calls + out


def test_usr1_stops_the_controller_and_requeues_the_job(tmp_path):
    code, seen = _run_script(tmp_path, signal.SIGUSR1)
    assert code == EXIT_PREEMPTED
    assert "requeue 77" in seen


def test_scancel_s_term_stops_without_a_requeue(tmp_path):
    code, seen = _run_script(tmp_path, signal.SIGTERM)
    assert code == EXIT_PREEMPTED
    assert "requeue" not in seen.replace("requeueable", "")
