"""Ray launcher: the workers are Ray actors, one per device of the plan.

The controller runs as a Ray driver (``python -m realign.controller.main RUN --launcher
ray``, usually the entrypoint of a Ray job, see :mod:`realign.launch.ray_backend`).
Devices are reserved with placement groups before any worker starts: one
``STRICT_PACK`` group per node of the plan's cluster, one bundle per device, so the
ranks of plan node ``i`` share a machine as the plan's meshes assume (tensor
parallelism stays inside a node). Each actor runs the same worker code as the other
launchers (:func:`realign.worker.main.main`) in its method ``run``, with the rank's
environment set first and its stdout/stderr sent to the rank's log file (the run
folder must be on a file system every node sees, as under Slurm).

Addresses: the controller listens on the driver's node IP; the gloo/NCCL rendezvous
is rank 0's node IP and a port that was free there, both asked from rank 0's actor
before the workers start.
"""
from __future__ import annotations

import logging
import os
import socket

from realign.errors import UserError
from realign.launch.base import Launcher, Network, WorkerExit

PG_READY_TIMEOUT_S = 120.0
CONNECT_TIMEOUT_S = 10.0
#: return code reported for an actor that died without returning (killed, OOM, node lost)
ACTOR_DIED = -9


def rank_bundles(n_nodes: int, gpus_per_node: int) -> list[tuple[int, int]]:
    """(placement group, bundle) of each rank: one group per plan node, ranks in node
    order. Example: 2 nodes x 2 devices -> [(0, 0), (0, 1), (1, 0), (1, 1)]."""
    return [(r // gpus_per_node, r % gpus_per_node) for r in range(n_nodes * gpus_per_node)]


def ray_init_address(address: str) -> str | None:
    """The address ``ray.init`` takes for the configured one: inside a Ray job
    (``RAY_ADDRESS`` set) or for ``auto``/a job-API URL, Ray's own discovery (None);
    otherwise the GCS address as given (``host:port`` or ``ray://host:port``)."""
    if address == "auto" or address.startswith(("http://", "https://")):
        return None
    return address


def check_reachable(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Raise a UserError at once when ``host:port`` does not accept a connection
    (``ray.init`` would otherwise retry for a minute or more)."""
    hostport = address.split("://", 1)[-1].rstrip("/")
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise UserError(f"{address!r} is not host:port (or auto / http://host:8265)",
                        field="launcher.address")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except OSError as e:
        raise UserError(f"no Ray cluster answers at {address} ({e}); start one with "
                        "`ray start --head` or fix the address", field="launcher.address") from e


class RealignWorker:
    """One device, as a Ray actor: reports where it runs, then runs the worker program
    (wrapped with ``ray.remote`` by :meth:`RayLauncher._reserve`)."""

    def node_ip(self) -> str:
        import ray
        return ray.util.get_node_ip_address()

    def run(self, env: dict[str, str], log_path: str) -> int:
        """The worker program with ``env`` set and stdout/stderr sent to ``log_path``;
        its exit code."""
        import sys
        os.environ.update(env)
        # Ray gives each actor its own device(s), visible as device 0 inside the actor
        os.environ["LOCAL_RANK"] = "0"
        sys.stdout.flush()
        sys.stderr.flush()
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        from realign.worker.main import main
        return main()


def ray_options(cfg):
    """The experiment's launcher section as Ray options (defaults when it names another
    launcher and ``--launcher ray`` chose this one)."""
    from realign.config.experiment import RayLauncherConfig
    if isinstance(cfg.launcher, RayLauncherConfig):
        return cfg.launcher
    return RayLauncherConfig(type="ray", threads_per_worker=cfg.launcher.threads_per_worker)


class RayLauncher(Launcher):
    def __init__(self, n_nodes: int, gpus_per_node: int, address: str = "auto",
                 runtime_env: dict | None = None, resources_per_worker: dict | None = None,
                 threads_per_worker: int = 1, device: str = "cpu"):
        self.n_nodes, self.gpus_per_node = n_nodes, gpus_per_node
        self.address = address
        self.runtime_env = dict(runtime_env or {})
        res = dict(resources_per_worker or {"CPU": 1.0})
        if device == "cuda":
            res.setdefault("GPU", 1.0)      # one bundle per device: a CUDA device is a GPU
        self.resources = res
        self.threads = threads_per_worker
        self.pgs: list = []
        self.actors: list = []
        self.futures: list = []
        self._exits: dict[int, int] = {}
        self._we_connected = False

    @classmethod
    def for_run(cls, spec) -> "RayLauncher":
        """The launcher a prepared run (:class:`~realign.run.spec.RunSpec`) asks for;
        connects to the Ray cluster and checks that it can hold the plan's workers
        (UserError otherwise)."""
        opts = ray_options(spec.config)
        cluster = spec.plan.cluster
        launcher = cls(cluster.n_nodes, cluster.gpus_per_node, opts.address,
                       opts.runtime_env, opts.resources_per_worker,
                       opts.threads_per_worker, spec.config.device)
        launcher.connect()
        return launcher

    # ---- cluster ---------------------------------------------------------------
    def connect(self) -> None:
        import ray
        if not ray.is_initialized():
            addr = ray_init_address(self.address)
            if addr is not None and not addr.startswith("ray://"):
                check_reachable(addr)
            try:
                # "auto": RAY_ADDRESS (set inside a Ray job) or the cluster started on
                # this machine; never a new private instance
                ray.init(address=addr or "auto", logging_level=logging.WARNING,
                         log_to_driver=False)
            except (ConnectionError, RuntimeError) as e:
                raise UserError(f"cannot connect to a Ray cluster at {self.address}: {e}",
                                field="launcher.address") from e
            self._we_connected = True
        self.check_capacity(ray.cluster_resources())

    def check_capacity(self, total: dict[str, float]) -> None:
        need = {k: v * self.n_nodes * self.gpus_per_node for k, v in self.resources.items()}
        short = {k: (v, total.get(k, 0.0)) for k, v in need.items() if total.get(k, 0.0) < v}
        if short:
            what = ", ".join(f"{k}: needs {v:g}, the cluster has {h:g}"
                             for k, (v, h) in short.items())
            raise UserError(f"the Ray cluster cannot hold {self.n_nodes * self.gpus_per_node} "
                            f"workers of {self.resources} ({what}); lower "
                            "launcher.resources_per_worker or add nodes",
                            field="launcher.resources_per_worker")

    def _reserve(self) -> None:
        """Placement groups and (idle) actors, one per rank."""
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        self.pgs = [placement_group([dict(self.resources)] * self.gpus_per_node,
                                    strategy="STRICT_PACK", name="")
                    for _ in range(self.n_nodes)]
        ready, _ = ray.wait([pg.ready() for pg in self.pgs], num_returns=len(self.pgs),
                            timeout=PG_READY_TIMEOUT_S)
        if len(ready) < len(self.pgs):
            raise RuntimeError(
                f"the Ray cluster did not place {self.n_nodes} node(s) x {self.gpus_per_node} "
                f"workers of {self.resources} within {PG_READY_TIMEOUT_S:.0f} s (available: "
                f"{ray.available_resources()})")
        env_vars = dict(self.runtime_env.get("env_vars", {}),
                        OMP_NUM_THREADS=str(self.threads), MKL_NUM_THREADS=str(self.threads),
                        TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
                        TRANSFORMERS_OFFLINE="1")
        runtime_env = dict(self.runtime_env, env_vars=env_vars)
        res = dict(self.resources)
        cpus, gpus = res.pop("CPU", 0.0), res.pop("GPU", 0.0)
        # max_concurrency 2: node_ip still answers while run() works
        cls = ray.remote(max_restarts=0, max_concurrency=2)(RealignWorker)
        self.actors = [
            cls.options(num_cpus=cpus, num_gpus=gpus, resources=res or None,
                        runtime_env=runtime_env,
                        scheduling_strategy=PlacementGroupSchedulingStrategy(
                            self.pgs[g], placement_group_bundle_index=b)).remote()
            for g, b in rank_bundles(self.n_nodes, self.gpus_per_node)]

    # ---- Launcher ----------------------------------------------------------------
    def network(self) -> Network:
        import ray
        self._reserve()
        # port 0: rank 0 serves the world's store on a port its system assigns
        master_addr = ray.get(self.actors[0].node_ip.remote())
        me = ray.util.get_node_ip_address()
        return Network(master_addr=master_addr, master_port=0,
                       bind_host=me, advertise_host=me, controller_port=0)

    def start(self, envs: list[dict[str, str]], log_paths: list[str]) -> None:
        if not self.actors:
            self._reserve()
        assert len(envs) == len(self.actors), (len(envs), len(self.actors))
        self.futures = [a.run.remote(env, log) for a, env, log in
                        zip(self.actors, envs, log_paths)]

    def poll(self) -> list[WorkerExit]:
        import ray
        from ray.exceptions import RayActorError, RayTaskError
        pending = [f for r, f in enumerate(self.futures) if r not in self._exits]
        if pending:
            done, _ = ray.wait(pending, num_returns=len(pending), timeout=0)
            for f in done:
                rank = self.futures.index(f)
                try:
                    self._exits[rank] = int(ray.get(f))
                except RayActorError:
                    self._exits[rank] = ACTOR_DIED
                except RayTaskError:
                    self._exits[rank] = 1
        return [WorkerExit(r, c) for r, c in sorted(self._exits.items())]

    def stop(self, grace_s: float = 5.0) -> None:
        import ray
        if not ray.is_initialized():
            return
        self.poll()
        if self.futures and not any(c != 0 for c in self._exits.values()):
            # a finished run: the workers are returning after "stop"; let them
            ray.wait(self.futures, num_returns=len(self.futures), timeout=grace_s)
        for a in self.actors:
            ray.kill(a, no_restart=True)
        from ray.util.placement_group import remove_placement_group
        for pg in self.pgs:
            remove_placement_group(pg)
        self.actors, self.pgs = [], []
        if self._we_connected:
            ray.shutdown()
            self._we_connected = False
