"""The local launcher's CPU workers, forked from one preloaded process
(realign/launch/forked_workers.py, realign/worker/zygote.py): each leads its own
session, writes to its log, gets its own environment, and its exit (an error, a
signal) reaches the controller's poll; stop ends every worker and the zygote."""
from __future__ import annotations

import os
import signal
import time
from multiprocessing.connection import Listener
from pathlib import Path

import pytest

from realign.launch.base import WorkerExit, worker_env
from realign.launch.local_launcher import LocalLauncher

pytestmark = pytest.mark.cpu_dist


def exits_within(launcher: LocalLauncher, want: set[WorkerExit], timeout_s: float = 60):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if want <= set(launcher.poll()):
            return set(launcher.poll())
        time.sleep(0.05)
    return set(launcher.poll())


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_forked_workers_sessions_logs_envs_and_exits(tmp_path):
    key = os.urandom(16)
    listener = Listener(("127.0.0.1", 0), authkey=key)
    listener._listener._socket.settimeout(120)
    addr = f"127.0.0.1:{listener.address[1]}"
    logs = [str(tmp_path / f"worker{r}.log") for r in range(3)]
    envs = [worker_env(r, 3, "127.0.0.1", 0, addr, key.hex(), logs[r], device="cpu")
            for r in range(3)]
    envs[2]["REALIGN_CONTROLLER"] = "127.0.0.1:1"       # rank 2 cannot reach its controller
    launcher = LocalLauncher(threads_per_worker=1)
    launcher.start(envs, logs)
    try:
        assert launcher.forked is not None and not launcher.procs
        hellos: dict[str, set[int]] = {}
        conns = []                  # held open: a worker leaves when its controller is gone
        for _ in range(4):                               # ranks 0 and 1: hello and watch
            conns.append(listener.accept())
            msg = conns[-1].recv()
            hellos.setdefault(msg[0], set()).add(msg[1])
        assert hellos == {"hello": {0, 1}, "watch": {0, 1}}   # each got its own RANK
        assert WorkerExit(2, 1) in exits_within(launcher, {WorkerExit(2, 1)})
        assert "ConnectionRefusedError" in Path(logs[2]).read_text()
        pids = launcher.forked.pids
        assert len(pids) == 3 and os.getpid() not in pids
        for r in (0, 1):
            assert os.getsid(pids[r]) == pids[r] == os.getpgid(pids[r])
            assert os.readlink(f"/proc/{pids[r]}/fd/1") == logs[r]
            assert os.readlink(f"/proc/{pids[r]}/fd/2") == logs[r]
        os.kill(pids[0], signal.SIGKILL)
        got = exits_within(launcher, {WorkerExit(0, -signal.SIGKILL)})
        assert got == {WorkerExit(2, 1), WorkerExit(0, -signal.SIGKILL)}
    finally:
        launcher.stop(grace_s=5)
    assert not alive(pids[1])
    assert WorkerExit(1, -signal.SIGTERM) in set(launcher.poll())
    assert launcher.forked.zygote.returncode == 0
    for c in conns:
        c.close()
    listener.close()


def test_a_zygote_that_cannot_import_fails_every_worker(tmp_path, monkeypatch):
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "torch.py").write_text("raise ImportError('no torch here')\n")
    logs = [str(tmp_path / f"worker{r}.log") for r in range(2)]
    envs = [worker_env(r, 2, "127.0.0.1", 0, "127.0.0.1:1", "00", logs[r], device="cpu")
            for r in range(2)]
    launcher = LocalLauncher(threads_per_worker=1)
    old = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(shadow), old) if p))
    launcher.start(envs, logs)
    try:
        got = exits_within(launcher, {WorkerExit(0, 1), WorkerExit(1, 1)})
        assert got == {WorkerExit(0, 1), WorkerExit(1, 1)}
        assert "no torch here" in (tmp_path / "zygote.log").read_text()
    finally:
        launcher.stop(grace_s=1)
