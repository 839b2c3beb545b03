"""The live worker processes of a local ``realign run``, found from outside: processes
whose stdout is one of the run's worker logs (``RUN/logs/worker<rank>.log``). This holds
for a worker started as its own program and for one forked from the launcher's preloaded
process alike (the latter's environment block in ``/proc`` is the preloaded process's)."""
from __future__ import annotations

import os
from pathlib import Path


def workers_of(run_dir: Path) -> list[int]:
    """PIDs of live (not zombie) processes writing to a worker log of ``run_dir``."""
    logs = run_dir / "logs"
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            out = Path(os.readlink(d / "fd" / "1"))
            if out.parent == logs and out.name.startswith("worker") and \
                    (d / "stat").read_text().split(")")[-1].split()[0] != "Z":
                pids.append(int(d.name))
        except OSError:
            continue
    return sorted(pids)
