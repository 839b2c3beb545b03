"""Stopping a run when asked: SIGTERM, SIGINT, or SIGUSR1 (what ``realign submit``'s
Slurm job asks for before its time limit, ``#SBATCH --signal``).

A first signal is a request: the controller lets the step in flight finish, writes a
checkpoint, stops the workers and exits with :data:`EXIT_PREEMPTED`; running the same
command again (or the requeued job) resumes from that checkpoint, bit-identical to a
run that was never stopped. A second signal stops at once: :class:`StopNow` is raised
wherever the controller is, the workers are killed, and the exit code is still
:data:`EXIT_PREEMPTED`; the last complete checkpoint is intact (checkpoints are
committed by one rename), so the run resumes from there.
"""
from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

from realign.run.exit_codes import EXIT_PREEMPTED

__all__ = ["EXIT_PREEMPTED", "STOP_SIGNALS", "StopNow", "StopRequest"]

#: the signals that ask a run to stop
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class StopNow(Exception):
    """A second stop signal: stop at once."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"{signal.Signals(signum).name} again: stopping at once")


class StopRequest:
    """The stop signals a controller received: ``signum`` is the first (None: none)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.noted = False          #: the controller has said it is stopping
        self._now = False

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def handle(self, signum: int, _frame=None) -> None:
        """The signal handler: note the first signal, raise :class:`StopNow` on the
        second (once; later ones are ignored while the run stops)."""
        if self.signum is None:
            self.signum = signum
        elif not self._now:
            self._now = True
            raise StopNow(signum)

    def ignore_more(self) -> None:
        """Ignore further signals (the run is stopping already)."""
        self._now = True

    @contextlib.contextmanager
    def installed(self) -> Iterator["StopRequest"]:
        """Handle :data:`STOP_SIGNALS` while open (in the main thread only: elsewhere,
        a benchmark's controller in a thread, signals keep their handlers)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        old = {s: signal.signal(s, self.handle) for s in STOP_SIGNALS}
        try:
            yield self
        finally:
            for s, h in old.items():
                signal.signal(s, h)
