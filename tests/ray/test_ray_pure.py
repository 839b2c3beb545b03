"""The Ray launcher's and back end's small pure pieces (no Ray cluster, no processes)."""
from __future__ import annotations

import socket
from pathlib import Path

import pytest

from realign.errors import UserError
from realign.launch.ray_backend import STATES, entrypoint
from realign.launch.ray_launcher import RayLauncher, check_reachable, rank_bundles, ray_init_address

pytestmark = pytest.mark.pure


def test_rank_bundles_fill_each_node_in_order():
    assert rank_bundles(1, 2) == [(0, 0), (0, 1)]
    assert rank_bundles(2, 2) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    got = rank_bundles(3, 4)
    assert len(got) == 12 and got[5] == (1, 1) and got[11] == (2, 3)


def test_ray_init_address():
    assert ray_init_address("auto") is None
    assert ray_init_address("http://head:8265") is None       # the driver runs inside the job
    assert ray_init_address("head:6379") == "head:6379"
    assert ray_init_address("ray://head:10001") == "ray://head:10001"


def test_entrypoint_runs_the_controller_with_the_ray_launcher():
    assert entrypoint(Path("/runs/a b")) == \
        "python -m realign.controller.main '/runs/a b' --launcher ray"


def test_every_ray_job_status_has_a_state():
    from ray.job_submission import JobStatus
    assert {s.value for s in JobStatus} == set(STATES)


def test_unreachable_address_is_a_user_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]                 # closed again: nothing listens
    with pytest.raises(UserError, match=f"no Ray cluster answers at 127.0.0.1:{port}") as e:
        check_reachable(f"127.0.0.1:{port}", timeout_s=2)
    assert e.value.field == "launcher.address"
    with pytest.raises(UserError, match="not host:port"):
        check_reachable("head-without-port")


def test_capacity_check_names_the_shortage():
    lau = RayLauncher(n_nodes=2, gpus_per_node=4, resources_per_worker={"CPU": 2},
                      device="cuda")
    assert lau.resources == {"CPU": 2, "GPU": 1.0}       # one bundle per device
    lau.check_capacity({"CPU": 16, "GPU": 8})
    with pytest.raises(UserError, match="GPU: needs 8, the cluster has 4") as e:
        lau.check_capacity({"CPU": 64, "GPU": 4})
    assert e.value.field == "launcher.resources_per_worker"
