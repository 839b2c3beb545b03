"""The Ray launcher and job back end on a real local Ray head (started by the session
fixture): the tiny GRPO experiment runs with its workers as Ray actors, both under a
driver started by hand and as a job of ``realign submit --launcher ray``, and learns;
a killed worker actor is reported and everything is released; ``realign cancel`` stops
a job; a Ray address that does not answer exits with code 2 at once. The Ray head
gets 4 CPUs and each worker actor 0.5 of one, so a 2-core machine runs the tier; most
of a run's time is the actors' start-up (imports).
"""
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

from tests.ray.head import free_port
from tests.run.conftest import experiment
from tests.run.run_records import metrics

pytestmark = [pytest.mark.ray, pytest.mark.slow]

REALIGN = [sys.executable, "-m", "realign.cli.main"]
RUN_TIMEOUT_S = 240
STEPS = 24


def ray_launcher(head, **changes) -> dict:
    return {"type": "ray", "address": head.dashboard, "resources_per_worker": {"CPU": 0.5},
            **changes}


def prepare(exp: Path, run_dir: Path, steps: int | None = None) -> None:
    from realign.run.prepare import prepare as prep
    prep(exp, run_dir=str(run_dir), steps=steps)


def controller(run_dir: Path, head, **kw) -> subprocess.Popen:
    """``python -m realign.controller.main RUN --launcher ray`` as a driver of the head."""
    env = dict(head.env, RAY_ADDRESS=head.gcs)
    return subprocess.Popen([sys.executable, "-m", "realign.controller.main", str(run_dir),
                             "--launcher", "ray"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


def assert_learned(run_dir: Path, steps: int = STEPS) -> None:
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(steps))
    first = sum(r["reward_mean"] for r in rows[:5]) / 5
    last = sum(r["reward_mean"] for r in rows[-5:]) / 5
    assert last > first + 0.08, (first, last)
    assert (run_dir / "final" / "actor" / "config.json").is_file()


def worker_pids(run_dir: Path) -> dict[int, int]:
    """rank -> pid of the live processes whose stdout is that rank's worker log (the
    actors redirect their output there)."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            target = os.readlink(d / "fd" / "1")
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        m = re.fullmatch(re.escape(str(run_dir / "logs")) + r"/worker(\d+)\.log", target)
        if m and state != "Z":
            out[int(m.group(1))] = int(d.name)
    return out


def live_placement_groups(head) -> list:
    from ray.util.state import list_placement_groups
    return [pg for pg in list_placement_groups(address=head.dashboard)
            if pg.state != "REMOVED"]


def wait_released(run_dir: Path, head, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while worker_pids(run_dir) or live_placement_groups(head):
        assert time.monotonic() < deadline, (worker_pids(run_dir), live_placement_groups(head))
        time.sleep(0.5)


def wait_steps(run_dir: Path, n: int, proc=None, timeout_s: float = RUN_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    m = run_dir / "metrics.jsonl"
    while not (m.exists() and m.read_text().count("\n") >= n):
        assert proc is None or proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"fewer than {n} steps in {timeout_s} s"
        time.sleep(0.2)


# ---- a driver by hand -------------------------------------------------------------------
def test_controller_as_ray_driver_learns(ray_head, tiny_assets, tmp_path):
    exp = experiment(tiny_assets, "tiny-grpo-cpu", tmp_path, run__steps=STEPS,
                     launcher=ray_launcher(ray_head, address="auto"))
    run_dir = tmp_path / "run"
    prepare(exp, run_dir)
    t0 = time.monotonic()
    p = controller(run_dir, ray_head)
    out, err = p.communicate(timeout=RUN_TIMEOUT_S)
    assert p.returncode == 0, out[-2000:] + err[-4000:]
    print(f"{STEPS} steps through the Ray launcher in {time.monotonic() - t0:.1f} s")
    assert_learned(run_dir)
    # the workers ran as actors of that driver and are gone with their placement group
    from ray.util.state import list_actors
    actors = [a for a in list_actors(address=ray_head.dashboard, limit=1000)
              if a.class_name == "RealignWorker"]
    assert len(actors) >= 2 and all(a.state == "DEAD" for a in actors), actors
    wait_released(run_dir, ray_head)


def test_killed_worker_actor_is_reported_and_released(ray_head, tiny_assets, tmp_path):
    exp = experiment(tiny_assets, "tiny-grpo-cpu", tmp_path, run__steps=200,
                     launcher=ray_launcher(ray_head))
    run_dir = tmp_path / "run"
    prepare(exp, run_dir)
    p = controller(run_dir, ray_head)
    try:
        wait_steps(run_dir, 2, p)
        pids = worker_pids(run_dir)
        assert sorted(pids) == [0, 1], pids
        os.kill(pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        out, err = p.communicate(timeout=60)
        assert time.monotonic() - t0 < 30
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 1, err[-3000:]
    assert re.search(r"worker \d failed", err), err[-3000:]
    wait_released(run_dir, ray_head)


# ---- realign submit / status / logs / cancel --------------------------------------------
def realign(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*REALIGN, *args], capture_output=True, text=True, timeout=timeout)


def submit(exp: Path, run_dir: Path) -> str:
    r = realign("submit", str(exp), "--launcher", "ray", "--run-dir", str(run_dir))
    assert r.returncode == 0, r.stdout + r.stderr
    m = re.search(r"submitted job (\S+) \(ray\)", r.stdout)
    assert m and f"run folder: {run_dir}" in r.stdout, r.stdout
    return m.group(1)


def status(job: str) -> dict:
    r = realign("status", job, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def wait_for(job: str, cond, timeout: float = RUN_TIMEOUT_S) -> None:
    """Poll the job's state in this process (a ``realign status`` per second would take
    CPU from the job on 2 cores); ``cond(state, steps_done)``."""
    from realign.launch.backends import backend
    from realign.launch.jobs import find, progress
    record = find(job)
    b = backend("ray")
    deadline = time.monotonic() + timeout
    while True:
        state = b.status(record)
        if cond(state.state, progress(Path(record.run_dir))[0] or 0):
            return
        assert time.monotonic() < deadline, f"job {job}: {state}\n" + \
            realign("logs", job).stdout[-4000:]
        time.sleep(0.5)


def test_submit_runs_a_ray_job_that_learns(ray_head, tiny_assets, tmp_path):
    exp = experiment(tiny_assets, "tiny-grpo-cpu", tmp_path, run__steps=STEPS,
                     launcher=ray_launcher(ray_head))
    run_dir = tmp_path / "run"
    job = submit(exp, run_dir)
    wait_for(job, lambda state, step: state in ("COMPLETED", "FAILED", "CANCELLED"))
    s = status(job)
    assert s["state"] == "COMPLETED", (s, realign("logs", job).stdout[-4000:])
    assert s["step"] == STEPS and s["steps"] == STEPS
    assert_learned(run_dir)
    logs = realign("logs", job).stdout
    assert f"final actor saved to {run_dir / 'final' / 'actor'}" in logs     # the driver's log
    assert "worker0.log <==" in logs and "worker1.log <==" in logs
    wait_released(run_dir, ray_head)


def test_cancel_stops_the_job_and_its_actors(ray_head, tiny_assets, tmp_path):
    exp = experiment(tiny_assets, "tiny-grpo-cpu", tmp_path, run__steps=200,
                     launcher=ray_launcher(ray_head))
    run_dir = tmp_path / "run"
    job = submit(exp, run_dir)
    wait_for(job, lambda state, step: step >= 2 or state not in ("PENDING", "RUNNING"))
    assert status(job)["state"] == "RUNNING"
    t0 = time.monotonic()
    r = realign("cancel", job)
    assert r.returncode == 0, r.stderr
    assert f"job {job} (ray): CANCELLED" in r.stdout, r.stdout
    assert time.monotonic() - t0 < 30
    assert status(job)["state"] == "CANCELLED"
    wait_released(run_dir, ray_head)


# ---- bad input: exit 2, quickly ----------------------------------------------------------
def test_unanswering_address_exits_2_quickly(tiny_assets, tmp_path):
    dead = f"127.0.0.1:{free_port()}"                  # nothing listens there
    for address in (f"http://{dead}", dead):
        exp = experiment(tiny_assets, "tiny-grpo-cpu", tmp_path,
                         launcher={"type": "ray", "address": address})
        t0 = time.monotonic()
        r = realign("submit", str(exp), "--run-dir", str(tmp_path / "run"), timeout=60)
        assert r.returncode == 2, r.stdout + r.stderr
        assert time.monotonic() - t0 < 30
        assert "launcher.address" in r.stderr and dead in r.stderr, r.stderr
        assert "Traceback" not in r.stderr, r.stderr
    # the controller of a prepared run folder, when its Ray cluster is gone
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "realign.controller.main", str(tmp_path / "run"),
                        "--launcher", "ray"], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2, r.stdout + r.stderr
    assert time.monotonic() - t0 < 30
    assert "launcher.address" in r.stderr and dead in r.stderr, r.stderr


def test_cluster_too_small_exits_2(ray_head, tiny_assets, tmp_path):
    exp = experiment(tiny_assets, "tiny-grpo-cpu", tmp_path,
                     launcher=ray_launcher(ray_head, resources_per_worker={"CPU": 3}))
    run_dir = tmp_path / "run"
    prepare(exp, run_dir)
    p = controller(run_dir, ray_head)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 2, out + err
    assert "launcher.resources_per_worker" in err and "needs 6" in err, err
