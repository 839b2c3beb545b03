"""The job back ends by name (the experiment's ``launcher.type``): an explicit table,
apart from :mod:`realign.launch.jobs`, which every back end builds on."""
from __future__ import annotations

from realign.errors import UserError
from realign.launch.jobs import JobBackend
from realign.launch.local_backend import LocalJobBackend
from realign.launch.ray_backend import RayJobBackend
from realign.launch.slurm_backend import SlurmBackend

#: back end name -> its class (each imports its scheduler's client only when used)
BACKENDS: dict[str, type[JobBackend]] = {
    "slurm": SlurmBackend,
    "local": LocalJobBackend,
    "ray": RayJobBackend,
}


def backend(name: str) -> JobBackend:
    """The back end called ``name``; a :class:`UserError` listing the known ones if none."""
    if name not in BACKENDS:
        raise UserError(f"unknown launcher {name!r}; allowed: {', '.join(BACKENDS)}",
                        field="launcher.type")
    return BACKENDS[name]()
