"""A one-node Slurm cluster in a temporary folder, for the ``slurm`` test tier.

munged (as the munge user, own key and socket), slurmctld and slurmd (as root, in the
foreground, so this module holds their process ids) with a ``slurm.conf`` whose every
state, spool, pid and log path lies in the folder. Nothing of the system's Slurm or
munge configuration is read or written: the tests point ``SLURM_CONF`` at this file.
Needs root (slurmd runs jobs as other users) and the Debian packages
(``tests/slurm/install_slurm.sh``).

``LocalSlurm(nodes=2)`` makes a two-node cluster on this machine: each slurmd runs in
its own network namespace (``ip netns``), the two joined by one veth pair named
``rl0`` in both (10.213.0.1 and 10.213.0.2); slurmctld runs in the first node's
namespace, so do the client commands (:attr:`LocalSlurm.client`). Traffic stays between
the test's own namespaces; the machine's own network is not touched.
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
CPUS = 2                       #: the machine's cores, split between the nodes
SUBNET = "10.213.0"            #: two-node clusters: node i at SUBNET.i on interface rl0
IFNAME = "rl0"

SLURM_CONF = """\
# one-node test cluster written by tests/slurm/cluster.py
ClusterName=realigntest
SlurmctldHost={host}({ctld_addr})
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket},cred_expire=5
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
{node_lines}
PartitionName={partition} Nodes={node_names} Default=YES MaxTime=INFINITE State=UP
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

    def __init__(self, nodes: int = 1):
        assert nodes in (1, 2), nodes
        self.root = Path(tempfile.mkdtemp(prefix="realign-slurm-"))
        self.root.chmod(0o755)                 # munged (munge user) must reach its folder
        self.conf = self.root / "slurm.conf"
        self.procs: dict[str, subprocess.Popen] = {}
        self.env = {"SLURM_CONF": str(self.conf)}
        self.nodes = [NODE] if nodes == 1 else [f"realign-n{i + 1}" for i in range(nodes)]
        tag = self.root.name.rsplit("-", 1)[1]
        self.netns = [] if nodes == 1 else [f"rlslurm-{tag}-{i + 1}" for i in range(nodes)]
        #: prefix for commands that must run where slurmctld is (the first node's namespace)
        self.client: list[str] = self._in_node(0, [])

    def addr(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}" if self.netns else "127.0.0.1"

    def _in_node(self, i: int, cmd: list[str]) -> list[str]:
        # nsenter, not `ip netns exec`: the latter remounts /sys, hiding /sys/fs/cgroup,
        # without which slurmd does not start
        return ["nsenter", f"--net=/run/netns/{self.netns[i]}", *cmd] if self.netns else cmd

    def _make_netns(self) -> None:
        """Namespaces with loopback up and one veth pair between them."""
        run = lambda *c: subprocess.run(c, check=True, capture_output=True)   # noqa: E731
        for ns in self.netns:
            run("ip", "netns", "add", ns)
            run("ip", "-n", ns, "link", "set", "lo", "up")
        run("ip", "link", "add", IFNAME, "netns", self.netns[0], "type", "veth",
            "peer", "name", IFNAME, "netns", self.netns[1])
        for i, ns in enumerate(self.netns):
            run("ip", "-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", IFNAME)
            run("ip", "-n", ns, "link", "set", IFNAME, "up")

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
        for sub in ("state", "spool", "run", "log", *(f"spool/{n}" for n in self.nodes)):
            (self.root / sub).mkdir()
        if self.netns:
            self._make_netns()
        sock = self._start_munge()
        cpus = CPUS // len(self.nodes)
        node_lines = "\n".join(f"NodeName={n} NodeAddr={self.addr(i)} CPUs={cpus} State=UNKNOWN"
                               for i, n in enumerate(self.nodes))
        self.conf.write_text(SLURM_CONF.format(
            host=socket.gethostname(), ctld_addr=self.addr(0), ctld_port=_free_port(),
            slurmd_port=_free_port(), munge_socket=sock, root=self.root, node_lines=node_lines,
            node_names=",".join(self.nodes), partition=PARTITION))
        env = dict(os.environ, **self.env)
        self.procs["slurmctld"] = subprocess.Popen(
            self._in_node(0, ["slurmctld", "-D", "-i", "-f", str(self.conf)]), env=env,
            stdout=subprocess.DEVNULL, stderr=open(self.root / "log" / "slurmctld.out", "wb"))
        for i, node in enumerate(self.nodes):
            self.procs[f"slurmd-{node}"] = subprocess.Popen(
                self._in_node(i, ["slurmd", "-D", "-N", node, "-f", str(self.conf)]), env=env,
                stdout=subprocess.DEVNULL, stderr=open(self.root / "log" / f"slurmd-{node}.out", "wb"))
        self._wait(self._nodes_idle, "idle nodes", "slurmctld", timeout_s)
        return self

    def _nodes_idle(self) -> bool:
        r = subprocess.run([*self.client, "sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True,
                           text=True, env=dict(os.environ, **self.env))
        return r.returncode == 0 and all(f"{n} idle" in r.stdout for n in self.nodes)

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
        r = subprocess.run([*self.client, "squeue", "-h", "-o", "%i %T"], capture_output=True,
                           text=True, env=dict(os.environ, **self.env))
        return r.stdout.split("\n") if r.stdout.strip() else []

    def stop(self) -> None:
        """Cancel every job, wait for their steps to end, then stop the daemons."""
        env = dict(os.environ, **self.env)
        if self.procs.get("slurmctld") and self.procs["slurmctld"].poll() is None:
            subprocess.run([*self.client, "scancel", "--full", "--signal=KILL", "-u", "root"],
                           env=env, capture_output=True)
            deadline = time.monotonic() + 20
            while self.squeue() and time.monotonic() < deadline:
                time.sleep(0.3)
        daemons = [n for n in self.procs if n.startswith("slurmd-")] + ["slurmctld", "munged"]
        for name in daemons:
            p = self.procs.get(name)
            if p is None or p.poll() is not None:
                continue
            p.terminate()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for ns in self.netns:                  # removes the veth pair with it
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        shutil.rmtree(self.root, ignore_errors=True)
