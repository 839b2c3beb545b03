"""Two Slurm nodes on this machine: each slurmd in its own network namespace, joined
only by a veth pair (``tests/slurm/cluster.py``). A job with one worker per node forms
its gloo groups across the pair, and its plan reallocates the actor between layouts
that live on different nodes (trained at PP2 across the nodes, generating at DP2), so
parameters cross nodes every step."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from tests.run.conftest import experiment
from tests.run.run_records import metrics
from tests.slurm.cluster import IFNAME, LocalSlurm, install

pytestmark = pytest.mark.slurm

MESH = {"first_gpu": 0, "n_gpus": 2}
MANUAL = {   # generate at DP2, train at PP2: one layer stack per node
    "actor.generate": {"mesh": MESH, "layout": {"tp": 1, "pp": 1, "dp": 2}, "micro_batches": 1},
    "actor.train": {"mesh": MESH, "layout": {"tp": 1, "pp": 2, "dp": 1}, "micro_batches": 2},
}
STEPS = 8


@pytest.fixture(scope="module")
def two_nodes():
    reason = install()
    if reason:
        pytest.skip(reason)
    if shutil.which("nsenter") is None or \
            subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
        pytest.skip("network namespaces (ip netns) are not available here")
    cluster = LocalSlurm(nodes=2)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def veth_bytes(cluster: LocalSlurm, node: int) -> int:
    out = subprocess.run(["ip", "-n", cluster.netns[node], "-s", "-j", "link", "show", IFNAME],
                         capture_output=True, text=True, check=True).stdout
    stats = json.loads(out)[0]["stats64"]
    return stats["rx"]["bytes"] + stats["tx"]["bytes"]


def test_workers_on_two_nodes_reallocate_across_them(two_nodes, tiny_assets, tmp_path):
    env = dict(os.environ, **two_nodes.env, REALIGN_HOME=str(tmp_path / "home"))
    cli = [*two_nodes.client, sys.executable, "-m", "realign.cli.main"]
    exp = experiment(tiny_assets, "tiny-grpo-cpu", tmp_path, cluster__nodes=2,
                     cluster__gpus_per_node=1, plan__manual=MANUAL, run__steps=STEPS,
                     launcher={"type": "slurm", "env": {"GLOO_SOCKET_IFNAME": IFNAME}})
    run_dir = tmp_path / "run"
    before = veth_bytes(two_nodes, 1)
    r = subprocess.run([*cli, "submit", str(exp), "--run-dir", str(run_dir)], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    job = r.stdout.split()[2]
    deadline = time.monotonic() + 240
    while True:
        s = json.loads(subprocess.run([*cli, "status", job, "--json"], env=env, check=True,
                                      capture_output=True, text=True).stdout)
        if s["state"] not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
            break
        assert time.monotonic() < deadline, s
        time.sleep(1.0)
    logs = subprocess.run([*cli, "logs", job], env=env, capture_output=True, text=True).stdout
    assert s["state"] == "COMPLETED", logs[-5000:]
    # one worker per node, each in its own network namespace
    assert f"slurm task: rank 0 on node {two_nodes.nodes[0]}" in \
        (run_dir / "logs" / "worker0.log").read_text()
    assert f"slurm task: rank 1 on node {two_nodes.nodes[1]}" in \
        (run_dir / "logs" / "worker1.log").read_text()
    script = (run_dir / "job.sbatch").read_text()
    assert "#SBATCH --nodes=2" in script and "#SBATCH --ntasks-per-node=1" in script
    plan = json.loads((run_dir / "plan.json").read_text())
    assert [(x["src_layout"]["pp"], x["dst_layout"]["dp"]) for x in plan["reallocations"]] \
        == [(2, 2)]
    rows = metrics(run_dir)
    assert [row["step"] for row in rows] == list(range(STEPS))
    assert all(row["realloc_bytes"] > 0 for row in rows)
    moved = sum(row["realloc_bytes"] for row in rows)
    crossed = veth_bytes(two_nodes, 1) - before
    # the second node's only link carried at least the reallocated parameters
    assert crossed >= moved, (crossed, moved)
    print(f"\ntwo nodes: {STEPS} steps, realloc {moved / 1e6:.2f} MB, veth {crossed / 1e6:.2f} MB")
