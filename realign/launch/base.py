"""The launcher interface: start N workers that connect back to the controller.

A worker is ``python -m realign.worker.main`` with its rank, the world size, the
rendezvous address of the gloo/NCCL world and the controller's address in its
environment (:func:`worker_env`); how and where the process starts is the
launcher's business. The controller only needs :meth:`Launcher.start`,
:meth:`Launcher.poll` and :meth:`Launcher.stop`.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from realign.run.spec import RunSpec


@dataclass(frozen=True)
class Network:
    """Where the controller listens and where the workers meet.

    ``master_addr``/``master_port``: the gloo/NCCL rendezvous (rank 0's host); port 0:
    rank 0 binds one the system chooses (:mod:`realign.worker.rendezvous`).
    ``bind_host``: the controller's listening interface; ``advertise_host``: how
    workers reach it; ``controller_port`` 0 = any.
    """

    master_addr: str = "127.0.0.1"
    master_port: int = 0
    bind_host: str = "127.0.0.1"
    advertise_host: str = "127.0.0.1"
    controller_port: int = 0


@dataclass(frozen=True)
class WorkerExit:
    rank: int
    returncode: int


def worker_env(rank: int, world: int, master_addr: str, master_port: int,
               controller_addr: str, authkey_hex: str, log_path: str,
               device: str = "cuda") -> dict[str, str]:
    """Environment of worker ``rank``: everything it needs to join and report. A
    ``device: cpu`` worker sees no GPU (``CUDA_VISIBLE_DEVICES`` empty), so a CPU run
    on a GPU machine computes on the CPU."""
    env = {
        "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
        "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
        "REALIGN_CONTROLLER": controller_addr, "REALIGN_AUTHKEY": authkey_hex,
        "REALIGN_WORKER_LOG": log_path,
    }
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


class Launcher(abc.ABC):
    """Starts and stops the worker processes of one run."""

    @classmethod
    @abc.abstractmethod
    def for_run(cls, spec: RunSpec) -> Launcher:
        """The launcher a prepared run asks for (its experiment's launcher options)."""

    def network(self) -> Network:
        """Addresses for this launcher's workers (default: everything on this host)."""
        return Network()

    @abc.abstractmethod
    def start(self, envs: list[dict[str, str]], log_paths: list[str]) -> None:
        """Start one worker per environment (rank order); stdout/stderr to its log."""

    @abc.abstractmethod
    def poll(self) -> list[WorkerExit]:
        """Workers that have exited so far."""

    @abc.abstractmethod
    def stop(self, grace_s: float = 5.0) -> None:
        """Terminate every worker still running (SIGTERM, then SIGKILL after grace)."""
