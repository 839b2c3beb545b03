"""``python -m realign.launch.slurm_task ENV_DIR``: one task of the workers' ``srun`` step.

Reads its rank from ``SLURM_PROCID``, takes that rank's environment from
``ENV_DIR/rank<R>.json`` (written by :class:`realign.launch.slurm.SlurmStepLauncher`),
runs ``python -m realign.worker.main`` with its output in the worker's log, passes on
the signals Slurm sends (SIGTERM at cancel), and records the worker's exit code in
``ENV_DIR/exit/rank<R>`` (negative: killed by that signal, as ``Popen`` reports it) so
the controller can name the worker that failed. Imports nothing heavy: it is started
once per device.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from realign.launch.slurm_common import local_device


def main(argv: list[str] | None = None) -> int:
    env_dir = Path((argv or sys.argv[1:])[0])
    rank = int(os.environ["SLURM_PROCID"])
    env = json.loads((env_dir / f"rank{rank}.json").read_text())
    full = dict(os.environ, **env)
    full["LOCAL_RANK"] = str(local_device(os.environ))    # the CUDA device it uses
    with open(env["REALIGN_WORKER_LOG"], "ab") as log:
        log.write(f"slurm task: rank {rank} on node {os.environ['SLURMD_NODENAME']} (job "
                  f"{os.environ['SLURM_JOB_ID']}, step {os.environ['SLURM_STEP_ID']})\n".encode())
        log.flush()
        child = subprocess.Popen([sys.executable, "-m", "realign.worker.main"], env=full,
                                 stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, lambda s, _f: child.send_signal(s))
        rc = child.wait()
    part = env_dir / "exit" / f"rank{rank}.part"
    part.write_text(str(rc))                        # as Popen has it: -N = killed by signal N
    os.replace(part, env_dir / "exit" / f"rank{rank}")
    return rc if rc >= 0 else 128 - rc             # the shell's convention for srun


if __name__ == "__main__":
    sys.exit(main())
