"""A one-node Slurm cluster in a temporary folder, for the ``slurm`` test tier.

munged (as the munge user, own key and socket), slurmctld and slurmd (as root, in the
foreground, so this module holds their process ids) with a ``slurm.conf`` whose every
state, spool, pid and log path lies in the folder. Nothing of the system's Slurm or
munge configuration is read or written: the tests point ``SLURM_CONF`` at this file.
Needs root (slurmd runs jobs as other users) and the Debian packages
(``tests/slurm/install_slurm.sh``).
"""
from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
NODE = "realign-n1"
PARTITION = "debug"
CPUS = 2

SLURM_CONF = """\
# one-node test cluster written by tests/slurm/cluster.py
ClusterName=realigntest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmdPidFile={root}/run/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
JobRequeue=1
# keep finished jobs visible to `scontrol show job` for the whole test session
MinJobAge=3600
# cancel: SIGTERM, then SIGKILL after KillWait seconds
KillWait=5
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName={partition} Nodes={node} Default=YES MaxTime=INFINITE State=UP
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def install() -> str | None:
    """Install the packages if missing; a reason to skip when that is impossible."""
    if os.geteuid() != 0:
        return "the slurm tier needs root (slurmd starts job steps as root here)"
    r = subprocess.run(["bash", str(HERE / "install_slurm.sh")], capture_output=True, text=True)
    if r.returncode == 3:
        return f"Slurm is not installed and cannot be: {r.stderr.strip()}"
    if r.returncode != 0:
        raise RuntimeError(f"install_slurm.sh failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    return None


class LocalSlurm:
    """Start with :meth:`start`, stop with :meth:`stop`; ``env`` is what clients need."""

    def __init__(self):
        self.root = Path(tempfile.mkdtemp(prefix="realign-slurm-"))
        self.root.chmod(0o755)                 # munged (munge user) must reach its folder
        self.conf = self.root / "slurm.conf"
        self.procs: dict[str, subprocess.Popen] = {}
        self.env = {"SLURM_CONF": str(self.conf)}

    # ---- daemons ----------------------------------------------------------------
    def _start_munge(self) -> Path:
        munge = pwd.getpwnam("munge")
        d = self.root / "munge"
        d.mkdir(mode=0o700)
        key = d / "munge.key"
        subprocess.run(["mungekey", "--create", "--keyfile", str(key)], check=True,
                       capture_output=True)
        for p in (d, key):
            os.chown(p, munge.pw_uid, munge.pw_gid)
        key.chmod(0o600)
        sock = d / "munge.socket"
        cmd = ["munged", "--foreground", "--force",
               f"--socket={sock}", f"--key-file={key}", f"--log-file={d}/munged.log",
               f"--pid-file={d}/munged.pid", f"--seed-file={d}/munged.seed"]
        self.procs["munged"] = subprocess.Popen(
            cmd, user=munge.pw_uid, group=munge.pw_gid, extra_groups=[],
            stdout=subprocess.DEVNULL, stderr=open(self.root / "log" / "munged.out", "wb"))
        self._wait(lambda: sock.exists(), "munged socket", "munged")
        d.chmod(0o711)                         # root clients connect to the socket
        return sock

    def start(self, timeout_s: float = 30.0) -> "LocalSlurm":
        for sub in ("state", "spool", "run", "log"):
            (self.root / sub).mkdir()
        sock = self._start_munge()
        self.conf.write_text(SLURM_CONF.format(
            host=socket.gethostname(), ctld_port=_free_port(), slurmd_port=_free_port(),
            munge_socket=sock, root=self.root, node=NODE, cpus=CPUS, partition=PARTITION))
        env = dict(os.environ, **self.env)
        self.procs["slurmctld"] = subprocess.Popen(
            ["slurmctld", "-D", "-i", "-f", str(self.conf)], env=env,
            stdout=subprocess.DEVNULL, stderr=open(self.root / "log" / "slurmctld.out", "wb"))
        self.procs["slurmd"] = subprocess.Popen(
            ["slurmd", "-D", "-N", NODE, "-f", str(self.conf)], env=env,
            stdout=subprocess.DEVNULL, stderr=open(self.root / "log" / "slurmd.out", "wb"))
        self._wait(self._node_idle, "node idle", "slurmctld", timeout_s)
        return self

    def _node_idle(self) -> bool:
        r = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True,
                           env=dict(os.environ, **self.env))
        return r.returncode == 0 and f"{NODE} idle" in r.stdout

    def _wait(self, cond, what: str, log: str, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not cond():
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"local Slurm: no {what} (exited: {dead}); logs in "
                                   f"{self.root / 'log'}:\n{self.logs()}")
            time.sleep(0.2)

    def logs(self) -> str:
        out = []
        for f in sorted((self.root / "log").glob("*")):
            out.append(f"--- {f.name} ---\n" + "\n".join(
                f.read_text(errors="replace").splitlines()[-20:]))
        return "\n".join(out)

    def squeue(self) -> list[str]:
        r = subprocess.run(["squeue", "-h", "-o", "%i %T"], capture_output=True, text=True,
                           env=dict(os.environ, **self.env))
        return r.stdout.split("\n") if r.stdout.strip() else []

    def stop(self) -> None:
        """Cancel every job, wait for their steps to end, then stop the daemons."""
        env = dict(os.environ, **self.env)
        if self.procs.get("slurmctld") and self.procs["slurmctld"].poll() is None:
            subprocess.run(["scancel", "--full", "--signal=KILL", "-u", "root"], env=env,
                           capture_output=True)
            deadline = time.monotonic() + 20
            while self.squeue() and time.monotonic() < deadline:
                time.sleep(0.3)
        for name in ("slurmd", "slurmctld", "munged"):
            p = self.procs.get(name)
            if p is None or p.poll() is not None:
                continue
            p.terminate()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        shutil.rmtree(self.root, ignore_errors=True)
