"""``python -m realign.controller.main RUN_DIR``: run the controller of a prepared run
folder (``realign run`` and ``realign submit`` prepare it: plan, checked config,
``run_spec.json``). Cluster jobs start this inside the allocation; ``--launcher``
chooses how the workers start there."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from realign.errors import UserError
from realign.launch.base import Launcher
from realign.launch.local_launcher import LocalLauncher
from realign.launch.ray_launcher import RayLauncher
from realign.launch.slurm_launcher import SlurmStepLauncher

#: launcher name -> its class (each imports its cluster's client only when it starts)
LAUNCHERS: dict[str, type[Launcher]] = {"local": LocalLauncher, "slurm-step": SlurmStepLauncher,
                                         "ray": RayLauncher}


def make_launcher(name: str, spec):
    """The launcher ``name`` for the prepared run ``spec`` (its experiment's options)."""
    if name not in LAUNCHERS:
        raise UserError(f"unknown launcher {name!r}; allowed: {', '.join(LAUNCHERS)}",
                        field="--launcher")
    return LAUNCHERS[name].for_run(spec)


def main(argv: list[str] | None = None) -> int:
    from realign.controller.controller import Controller
    from realign.run.spec import RunSpec

    p = argparse.ArgumentParser(prog="python -m realign.controller.main")
    p.add_argument("run_dir")
    p.add_argument("--launcher", default="local")
    args = p.parse_args(argv)
    try:
        spec = RunSpec.load(Path(args.run_dir))
        return Controller(spec, make_launcher(args.launcher, spec)).run()
    except UserError as e:           # bad input, found before any worker started
        print(f"realign controller: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
