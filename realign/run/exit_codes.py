"""The exit codes of a run that a launcher acts on (``docs/reliability.md`` lists all):
0 finished, 1 failed while running, 2 refused input, and :data:`EXIT_PREEMPTED`."""
from __future__ import annotations

#: "preempted, resumable": a stop signal ended the run after a checkpoint (or, on a
#: second signal, at once); running the same command again resumes. A Slurm job that
#: was asked to stop before its time limit requeues itself on it.
EXIT_PREEMPTED = 3
