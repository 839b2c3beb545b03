"""Stopping when asked, hangs turned into errors, workers that outlive their controller:
`realign run` of the tiny GRPO experiment on CPU, real worker processes over gloo.

Where a test needs the run to be at a known point, a worker stalls there through the
test-only hook ``REALIGN_TEST_STALL=RANK:CALL:SECONDS[:STEP]``
(:mod:`realign.worker.watchdog`), which logs a line when the stall begins; the bounds
on how long things take are liveness bounds, never timings.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from realign.controller.stopping import EXIT_PREEMPTED
from realign.run.checkpoint import committed, problems
from realign.worker.watchdog import STALL_ENV
from tests.run.conftest import experiment
from tests.run.live_workers import workers_of
from tests.run.run_records import final_weights, metrics

pytestmark = pytest.mark.cpu_dist

REALIGN = [sys.executable, "-m", "realign.cli.main"]


def start(exp: Path, run_dir: Path, stall: str | None = None, *extra: str) -> subprocess.Popen:
    env = dict(os.environ)
    env.pop(STALL_ENV, None)
    if stall:
        env[STALL_ENV] = stall
    return subprocess.Popen([*REALIGN, "run", str(exp), "--run-dir", str(run_dir), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def run(exp: Path, run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([*REALIGN, "run", str(exp), "--run-dir", str(run_dir), *extra],
                          capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in os.environ.items() if k != STALL_ENV})


def wait_for_stall(run_dir: Path, rank: int, p: subprocess.Popen, timeout_s: float = 240) -> None:
    """Until worker ``rank``'s log says the stall began (or the run ended: then fail)."""
    log = run_dir / "logs" / f"worker{rank}.log"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if log.exists() and STALL_ENV in log.read_text(errors="replace"):
            return
        if p.poll() is not None:
            pytest.fail(f"the run ended ({p.returncode}) before the stall: "
                        f"{p.stderr.read()[-3000:]}")
        time.sleep(0.05)
    pytest.fail("the stall did not begin")


def gone_within(run_dir: Path, bound_s: float) -> bool:
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        if not workers_of(run_dir):
            return True
        time.sleep(0.2)
    return False


def test_sigterm_finishes_the_step_checkpoints_and_resumes_bit_identically(tiny_assets,
                                                                           tmp_path):
    exp = experiment(tiny_assets, "tiny-grpo-cpu", tmp_path, run__steps=8,
                     run__checkpoint_interval=4)
    whole = tmp_path / "whole"
    r = run(exp, whole)
    assert r.returncode == 0, r.stderr[-3000:]
    cut = tmp_path / "cut"
    # rank 0 holds step 5 up in its training call; SIGTERM lands inside that step
    p = start(exp, cut, "0:actor.train:3:5")
    wait_for_stall(cut, 0, p)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=120)
    assert p.returncode == EXIT_PREEMPTED, err[-3000:]
    assert "stopped by SIGTERM after step 6 of 8" in out, out
    assert "exit 3: preempted, resumable" in out
    found = committed(cut)
    assert found and found[-1][0] == 6, found          # step 5 finished, then saved
    assert problems(found[-1][1]) == []
    assert not (cut / "final").exists()
    assert [row["step"] for row in metrics(cut)] == list(range(6))
    assert gone_within(cut, 15)
    r = run(exp, cut)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming from" in r.stdout and "step_000006" in r.stdout, r.stdout
    assert [row["step"] for row in metrics(cut)] == list(range(8))
    a, b = final_weights(whole), final_weights(cut)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [row["reward_mean"] for row in metrics(whole)] == \
        [row["reward_mean"] for row in metrics(cut)]


def test_a_second_signal_stops_at_once_and_keeps_the_last_checkpoint(tiny_assets, tmp_path):
    exp = experiment(tiny_assets, "tiny-grpo-cpu", tmp_path, run__steps=6,
                     run__checkpoint_interval=2)
    rd = tmp_path / "run"
    # rank 1 stalls for long in step 3's generation: only a second signal ends this soon
    p = start(exp, rd, "1:actor.generate:600:3")
    wait_for_stall(rd, 1, p)
    p.send_signal(signal.SIGINT)
    time.sleep(1.0)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=60)
    assert p.returncode == EXIT_PREEMPTED, err[-3000:]
    assert "again: stopping at once: workers killed" in out, out
    assert "the last complete checkpoint is step_000002" in out, out
    assert gone_within(rd, 15)
    found = committed(rd)
    assert [s for s, _ in found] == [2] and problems(found[-1][1]) == []
    r = run(exp, rd)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming from" in r.stdout and "step_000002" in r.stdout
    assert [row["step"] for row in metrics(rd)] == list(range(6))


def test_workers_exit_within_seconds_when_the_controller_is_killed(tiny_assets, tmp_path):
    exp = experiment(tiny_assets, "tiny-grpo-cpu", tmp_path, run__steps=4)
    rd = tmp_path / "run"
    p = start(exp, rd, "0:actor.train:600")     # rank 0 is busy in a call for long
    wait_for_stall(rd, 0, p)
    assert len(workers_of(rd)) == 2
    p.kill()
    p.wait()
    assert gone_within(rd, 15), "workers outlived their SIGKILLed controller by 15 s"
    logs = "".join((rd / "logs" / f"worker{r}.log").read_text(errors="replace")
                   for r in (0, 1))
    assert "the controller is gone" in logs


def test_a_stalled_rank_fails_the_run_naming_the_call_and_the_rank(tiny_assets, tmp_path):
    exp = experiment(tiny_assets, "tiny-grpo-cpu", tmp_path, run__steps=4,
                     run__call_timeout_s=20)
    rd = tmp_path / "run"
    p = start(exp, rd, "1:actor.generate:600")
    out, err = p.communicate(timeout=240)
    assert p.returncode == 1, err[-3000:]
    assert "step 0: actor.generate (ranks 0, 1) did not finish within 20 s" in err, err
    assert "rank 1 did not arrive at its collectives" in err, err
    assert "rank 0 " in err                    # waiting on its peer, or finished the call
    assert gone_within(rd, 15)
