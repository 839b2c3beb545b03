"""A local Ray head for the ray tier: ``ray start --head`` with the dashboard (job API)
on free ports, its temp folder in a short private directory (Ray's socket paths must
stay under 107 characters), torn down by killing its own process group."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

START_TIMEOUT_S = 90.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalRayHead:
    def __init__(self, num_cpus: float = 4):
        self.num_cpus = num_cpus
        self.tmp = Path(tempfile.mkdtemp(prefix="rl-ray-", dir="/tmp"))
        self.port, self.dash_port = free_port(), free_port()
        self.gcs = f"127.0.0.1:{self.port}"
        self.dashboard = f"http://127.0.0.1:{self.dash_port}"
        bin_dir = str(Path(sys.executable).parent)
        # the job's entrypoint runs `python`: this interpreter, as on a real cluster
        # where the head is started from the environment that has realign installed
        self.env = dict(os.environ, PATH=f"{bin_dir}:{os.environ.get('PATH', '')}",
                        RAY_USAGE_STATS_ENABLED="0")
        self.env.pop("RAY_ADDRESS", None)
        self.pgid: int | None = None

    def start(self) -> None:
        ray = str(Path(sys.executable).parent / "ray")
        cmd = [ray, "start", "--head", "--node-ip-address", "127.0.0.1",
               "--port", str(self.port), "--dashboard-host", "127.0.0.1",
               "--dashboard-port", str(self.dash_port), "--include-dashboard", "true",
               "--ray-client-server-port", str(free_port()),
               "--dashboard-agent-listen-port", str(free_port()),
               "--num-cpus", str(self.num_cpus), "--temp-dir", str(self.tmp / "ray"),
               "--disable-usage-stats"]
        log = open(self.tmp / "ray-start.log", "wb")
        p = subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True)
        self.pgid = p.pid                      # the daemons stay in this process group
        rc = p.wait(timeout=START_TIMEOUT_S)
        log.close()
        if rc != 0:
            raise RuntimeError(f"ray start failed ({rc}):\n"
                               + (self.tmp / "ray-start.log").read_text()[-3000:])
        self._wait_for_job_api()

    def _wait_for_job_api(self) -> None:
        from ray.job_submission import JobSubmissionClient
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                JobSubmissionClient(self.dashboard).list_jobs()
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def _our_pids(self) -> list[int]:
        """Processes of this head: its process group, or naming its temp folder."""
        out = []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                pgid = os.getpgid(int(d.name))
                cmd = (d / "cmdline").read_bytes()
            except (OSError, ProcessLookupError):
                continue
            if pgid == self.pgid or str(self.tmp).encode() in cmd:
                out.append(int(d.name))
        return out

    def stop(self) -> None:
        if self.pgid is not None:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                for pid in self._our_pids():
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        pass
                if sig == signal.SIGTERM:
                    time.sleep(2.0)
        shutil.rmtree(self.tmp, ignore_errors=True)
